#pragma once
// Tokens and the syntax tree of a chat template, and the lexer and parser that make them.
// Every token and node carries its byte offset in the template source, for line:column in
// errors.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "jinja_value.hpp"

namespace writescope::text::jinja {

// An error at a place in the template (offset into the source).
class SourceError : public std::runtime_error {
  public:
    SourceError(std::string message, std::uint32_t at)
        : std::runtime_error(std::move(message)), offset(at) {}
    std::uint32_t offset;
};

struct Token {
    enum class Type : std::uint8_t {
        text,
        open_expr,   // {{
        close_expr,  // }}
        open_stmt,   // {%
        close_stmt,  // %}
        name,
        string,
        integer,
        floating,
        op,  // operators and punctuation; `value` holds the spelling
        end
    };
    Type type;
    std::string value;
    std::uint32_t offset;
};

// Splits a template into text and tag tokens, applying Jinja's whitespace control the way
// transformers configures it: trim_blocks, lstrip_blocks, `-` markers, one trailing newline
// dropped.
std::vector<Token> tokenize(std::string_view source);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
    enum class Kind : std::uint8_t {
        literal,  // value
        name,     // name
        list,     // args
        tuple,    // args
        dict,     // args: key, value, key, value...
        attr,     // args[0].name
        item,     // args[0][args[1]]
        slice,    // args[0][args[1]:args[2]:args[3]] (null pointers where omitted)
        call,     // args[0](args[1..], kwargs)
        filter,   // args[0] | name(args[1..], kwargs)
        test,     // args[0] is [not] name(args[1..]); negate
        neg,      // -args[0]
        pos,      // +args[0]
        not_,     // not args[0]
        and_,     // args[0] and args[1]
        or_,      // args[0] or args[1]
        binary,   // args[0] op args[1]: + - * / // % ** ~
        compare,  // args[0] ops[0] args[1] ops[1] args[2]... (chained as in Python)
        cond,     // args[1] if args[0] else args[2] (args[2] may be null)
    };
    Kind kind;
    std::uint32_t offset;
    Value value;
    std::string name;
    bool negate = false;
    std::vector<ExprPtr> args;
    std::vector<std::pair<std::string, ExprPtr>> kwargs;
    std::vector<std::string> ops;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Param {
    std::string name;
    ExprPtr default_value;  // may be null
};

struct Stmt {
    enum class Kind : std::uint8_t {
        text,          // text
        output,        // {{ expr }}
        if_,           // expr, body, else_body (an elif is an if_ alone in else_body)
        for_,          // target in expr [if cond], body, else_body
        set,           // target = expr
        set_block,     // set target %} body {% endset
        macro,         // name(params) body
        call_block,    // {% call(params) expr %} body
        filter_block,  // filter expr (a filter node whose args[0] is null) body
        break_,
        continue_,
    };
    Kind kind;
    std::uint32_t offset;
    std::string text;
    ExprPtr expr;
    ExprPtr target;
    ExprPtr cond;
    Body body;
    Body else_body;
    std::string name;
    std::vector<Param> params;
};

struct Program {
    std::string source;
    Body body;
};

// Parses tokens into a Program and checks that every statement, filter, test, method and
// function it names is supported. Throws SourceError.
void parse(const std::vector<Token>& tokens, Program& program);

// Sets of supported names (the evaluator implements each).
bool is_supported_filter(std::string_view name);
bool is_supported_test(std::string_view name);
bool is_supported_method(std::string_view name);
bool is_supported_global(std::string_view name);

}  // namespace writescope::text::jinja
