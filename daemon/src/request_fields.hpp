// Reading a request body's fields: present, a boolean, a number, an integer. Each failure is
// an ApiError (400) naming the field.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "api.hpp"

namespace writescope::daemon {

// Present and not null.
inline bool present(const nlohmann::json& body, const char* name) {
    return body.contains(name) && !body.at(name).is_null();
}

inline bool bool_of(const nlohmann::json& body, const char* name, bool absent) {
    if (!present(body, name)) return absent;
    if (!body[name].is_boolean())
        throw ApiError{400, fmt::format("\"{}\" must be a boolean", name)};
    return body[name].get<bool>();
}

inline double number_of(const nlohmann::json& body, const char* name) {
    const auto& v = body.at(name);
    if (!v.is_number()) throw ApiError{400, fmt::format("\"{}\" must be a number", name)};
    return v.get<double>();
}

// An integer value (the caller has checked is_number_integer) as int64_t. JSON parses an
// integer past int64_t's range as unsigned, and get<int64_t> would wrap it to a negative
// number, which the callers' range checks would then report as that number: such a value is
// refused here as written. `what` names it ("\"max_tokens\"", "prompt[3]").
inline std::int64_t int64_value(const nlohmann::json& v, std::string_view what) {
    if (v.is_number_unsigned() &&
        v.get<std::uint64_t>() >
            static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw ApiError{400, fmt::format("{} = {} is out of range", what, v.dump())};
    return v.get<std::int64_t>();
}

// An integer field (not 2.0: "must be an integer").
inline std::int64_t integer_of(const nlohmann::json& body, const char* name) {
    const auto& v = body.at(name);
    if (!v.is_number_integer()) throw ApiError{400, fmt::format("\"{}\" must be an integer", name)};
    return int64_value(v, fmt::format("\"{}\"", name));
}

}  // namespace writescope::daemon
