#pragma once
// The evaluator: renders a parsed Program over a context value with Python Jinja's semantics
// (as transformers' ImmutableSandboxedEnvironment runs chat templates), within limits.
#include <string>

#include "jinja_ast.hpp"
#include "writescope/core/text/chat_template.hpp"

namespace writescope::text::jinja {

// raise_exception(message) in a template: the message alone, without a position.
class RaisedError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// `context` must be a dict. Throws SourceError (with the offset of the failing construct) or
// RaisedError.
std::string render(const Program& program, const Value& context, const ChatTemplateLimits& limits);

}  // namespace writescope::text::jinja
