#include "writescope/core/text/chat_template.hpp"

#include <algorithm>

#include "jinja_ast.hpp"
#include "jinja_eval.hpp"

namespace writescope::text {

namespace {

// "name:line:column: message", the column counted in code points from 1.
std::string located(std::string_view name, std::string_view source, std::uint32_t offset,
                    std::string_view message) {
    const std::size_t at = std::min<std::size_t>(offset, source.size());
    std::size_t line = 1, line_start = 0;
    for (std::size_t k = 0; k < at; ++k) {
        if (source[k] == '\n') {
            ++line;
            line_start = k + 1;
        }
    }
    const std::size_t column =
        jinja::code_points(source.substr(line_start, at - line_start)).size() + 1;
    std::string out(name);
    out += ':';
    out += std::to_string(line);
    out += ':';
    out += std::to_string(column);
    out += ": ";
    out += message;
    return out;
}

template <class Json>
jinja::Value from_json(const Json& j, int depth_left) {
    using jinja::Value;
    if (depth_left <= 0) throw ChatTemplateError("chat template context nested too deeply");
    switch (j.type()) {
        case nlohmann::json::value_t::null:
            return Value::none();
        case nlohmann::json::value_t::boolean:
            return Value::boolean(j.template get<bool>());
        case nlohmann::json::value_t::number_integer:
            return Value::integer(j.template get<std::int64_t>());
        case nlohmann::json::value_t::number_unsigned: {
            const auto u = j.template get<std::uint64_t>();
            if (u <= static_cast<std::uint64_t>(INT64_MAX))
                return Value::integer(static_cast<std::int64_t>(u));
            return Value::floating(static_cast<double>(u));
        }
        case nlohmann::json::value_t::number_float:
            return Value::floating(j.template get<double>());
        case nlohmann::json::value_t::string:
            return Value::string(j.template get<std::string>());
        case nlohmann::json::value_t::array: {
            jinja::Array items;
            items.reserve(j.size());
            for (const auto& item : j)
                items.push_back(from_json(item, depth_left - 1));
            return Value::array(std::move(items));
        }
        case nlohmann::json::value_t::object: {
            auto o = std::make_shared<jinja::Object>();
            o->items.reserve(j.size());
            for (auto it = j.begin(); it != j.end(); ++it) {
                o->items.emplace_back(it.key(), from_json(it.value(), depth_left - 1));
            }
            o->build_index();
            return Value::object(std::move(o));
        }
        default:
            return Value{};  // binary, discarded
    }
}

}  // namespace

ChatTemplate ChatTemplate::compile(std::string_view source, std::string_view name_for_errors,
                                   ChatTemplateLimits limits) {
    auto program = std::make_shared<jinja::Program>();
    program->source = std::string(source);
    try {
        jinja::parse(jinja::tokenize(program->source), *program);
    } catch (const jinja::SourceError& e) {
        throw ChatTemplateError(located(name_for_errors, program->source, e.offset, e.what()));
    }
    ChatTemplate t;
    t.program_ = std::move(program);
    t.name_ = std::string(name_for_errors);
    t.limits_ = limits;
    return t;
}

namespace {
template <class Json>
std::string render_json(const jinja::Program& program, const std::string& name,
                        const ChatTemplateLimits& limits, const Json& context) {
    if (!context.is_object()) throw ChatTemplateError(name + ": the context must be a JSON object");
    const jinja::Value values = from_json(context, limits.max_depth);
    try {
        return jinja::render(program, values, limits);
    } catch (const jinja::SourceError& e) {
        throw ChatTemplateError(located(name, program.source, e.offset, e.what()));
    } catch (const jinja::RaisedError& e) {
        throw ChatTemplateError(e.what());
    } catch (const std::bad_alloc&) {
        throw ChatTemplateError(name + ": out of memory while rendering");
    }
}
}  // namespace

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
    return render_json(*program_, name_, limits_, context);
}

std::string ChatTemplate::render(const nlohmann::json& context) const {
    return render_json(*program_, name_, limits_, context);
}

}  // namespace writescope::text
