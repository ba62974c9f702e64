#pragma once
// The values a chat template computes with: Python's types as Jinja sees them. Strings, lists
// and dicts are immutable and shared; a namespace() is the one mutable value.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace writescope::text::jinja {

struct Value;
struct Object;
struct Callable;

using Array = std::vector<Value>;

struct Value {
    enum class Kind : std::uint8_t {
        undefined,
        none,
        boolean,
        integer,
        floating,
        string,
        array,
        object,
        ns,  // namespace(): an Object whose attributes `set` may assign
        function
    };
    Kind kind = Kind::undefined;
    bool b = false;
    std::uint32_t nest = 0;  // depth of lists and dicts inside (bounded: destruction recurses)
    std::int64_t i = 0;
    double f = 0;
    std::shared_ptr<const std::string> s;
    std::shared_ptr<const Array> a;
    std::shared_ptr<Object> o;  // const for Kind::object by convention, mutable for Kind::ns
    std::shared_ptr<const Callable> fn;

    static Value none() { return with(Kind::none); }
    static Value boolean(bool v) {
        Value r = with(Kind::boolean);
        r.b = v;
        return r;
    }
    static Value integer(std::int64_t v) {
        Value r = with(Kind::integer);
        r.i = v;
        return r;
    }
    static Value floating(double v) {
        Value r = with(Kind::floating);
        r.f = v;
        return r;
    }
    static Value string(std::string v) {
        Value r = with(Kind::string);
        r.s = std::make_shared<const std::string>(std::move(v));
        return r;
    }
    static Value array(Array v) {
        Value r = with(Kind::array);
        for (const auto& item : v)
            r.nest = std::max(r.nest, item.nest + 1);
        r.a = std::make_shared<const Array>(std::move(v));
        return r;
    }
    // A dict (Kind::object) or namespace (Kind::ns) whose items are already filled in.
    static Value object(std::shared_ptr<Object> v, Kind kind = Kind::object);

    bool is(Kind k) const { return kind == k; }
    bool is_undefined() const { return kind == Kind::undefined; }
    bool is_none() const { return kind == Kind::none; }
    bool is_string() const { return kind == Kind::string; }
    bool is_number() const { return kind == Kind::integer || kind == Kind::floating; }
    bool is_mapping() const { return kind == Kind::object; }
    const std::string& str() const { return *s; }

  private:
    static Value with(Kind k) {
        Value r;
        r.kind = k;
        return r;
    }
};

// A dict (keys in insertion order) or a namespace.
struct Object {
    std::vector<std::pair<std::string, Value>> items;

    const Value* find(std::string_view key) const;
    void set(const std::string& key, Value v);  // namespaces only
    void build_index();                         // after filling `items` in bulk

  private:
    std::unordered_map<std::string_view, std::size_t> index_;  // only for large dicts
};

// Python's str() of a value, as {{ value }} prints it.
std::string to_display(const Value& v, int depth_left);
// Python's repr() (how lists and dicts print their items).
std::string to_repr(const Value& v, int depth_left);
// Python's repr() of a float (the shortest string that reads back the same double).
std::string float_repr(double v);

struct JsonOptions {
    int indent = -1;  // < 0: on one line
    bool ensure_ascii = false;
    bool sort_keys = false;
    std::string item_separator = ", ";
    std::string key_separator = ": ";
};
// json.dumps as transformers' tojson filter calls it. Throws std::runtime_error for values
// JSON cannot hold (functions).
void to_json(const Value& v, const JsonOptions& options, int level, int depth_left,
             std::string& out);

bool truthy(const Value& v);
// Python's ==: numbers by value (True == 1), sequences and dicts item by item.
bool equal(const Value& a, const Value& b, int depth_left);
const char* type_name(const Value& v);

// UTF-8 helpers: code points (invalid bytes count as one code point each, never read past).
std::vector<std::string_view> code_points(std::string_view s);
bool is_python_space(std::uint32_t cp);
std::uint32_t decode_at(std::string_view s, std::size_t& pos);  // advances pos

}  // namespace writescope::text::jinja
