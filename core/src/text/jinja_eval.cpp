#include "jinja_eval.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>

namespace writescope::text::jinja {

struct Scope {
    std::shared_ptr<Scope> parent;
    std::vector<std::pair<std::string, Value>> vars;

    const Value* find(std::string_view name) const {
        for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
            for (const auto& [k, v] : s->vars) {
                if (k == name) return &v;
            }
        }
        return nullptr;
    }
    void set(const std::string& name, Value v) {
        for (auto& [k, old] : vars) {
            if (k == name) {
                old = std::move(v);
                return;
            }
        }
        vars.emplace_back(name, std::move(v));
    }
};

struct Callable {
    enum class Kind { macro, caller, global } kind;
    std::string name;
    const Stmt* node = nullptr;  // the macro or the call block
    std::shared_ptr<Scope> closure;
};

namespace {

using Kind = Value::Kind;

struct Args {
    std::vector<Value> pos;
    std::vector<std::pair<std::string, Value>> kw;

    // The argument at `index` or named `name`, or null when absent.
    const Value* get(std::size_t index, std::string_view name) const {
        if (index < pos.size()) return &pos[index];
        for (const auto& [k, v] : kw) {
            if (k == name) return &v;
        }
        return nullptr;
    }
};

Value undefined_named(std::string hint) {
    Value v;
    v.s = std::make_shared<const std::string>(std::move(hint));
    return v;
}

std::string describe_undefined(const Value& v) {
    return v.s ? *v.s : std::string("value is undefined");
}

std::string_view trim_set(std::string_view s, const Value* chars, bool left, bool right) {
    const auto strip_cp = [&](std::uint32_t cp, std::string_view bytes) {
        if (chars == nullptr || chars->is_none() || chars->is_undefined())
            return is_python_space(cp);
        return chars->str().find(bytes) != std::string::npos;
    };
    std::size_t begin = 0, end = s.size();
    if (left) {
        while (begin < end) {
            std::size_t next = begin;
            const std::uint32_t cp = decode_at(s, next);
            if (!strip_cp(cp, s.substr(begin, next - begin))) break;
            begin = next;
        }
    }
    if (right) {
        while (end > begin) {
            std::size_t start = end - 1;
            while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80)
                --start;
            std::size_t next = start;
            const std::uint32_t cp = decode_at(s, next);
            if (next != end || !strip_cp(cp, s.substr(start, end - start))) break;
            end = start;
        }
    }
    return s.substr(begin, end - begin);
}

char ascii_upper(char c) {
    return (c >= 'a' && c <= 'z') ? static_cast<char>(c - 32) : c;
}
char ascii_lower(char c) {
    return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c;
}

class Interp {
  public:
    Interp(const Program& program, const ChatTemplateLimits& limits)
        : program_(program), limits_(limits) {}

    ~Interp() {
        // Namespaces may hold themselves (`set ns.x = ns`): break such cycles.
        for (auto& ns : namespaces_)
            ns->items.clear();
        // A macro (and a call block's caller) holds the scope it is defined in, which holds it:
        // break those cycles too (found by tests/fuzz, fuzz_chat_template_compile: every render
        // of a template defining a macro leaked its scopes).
        for (auto& fn : callables_)
            fn->closure.reset();
    }

    std::string run(const Value& context) {
        auto scope = std::make_shared<Scope>();
        for (const auto& [k, v] : context.o->items)
            scope->set(k, v);
        std::string out;
        exec(program_.body, scope, out);
        return out;
    }

  private:
    enum class Flow { normal, break_, continue_ };

    [[noreturn]] static void fail(const std::string& message, std::uint32_t offset) {
        throw SourceError(message, offset);
    }

    void step(std::uint32_t offset) {
        if (++steps_ > limits_.max_steps) {
            fail("the template ran more than " + std::to_string(limits_.max_steps) + " steps",
                 offset);
        }
    }
    // Work proportional to the bytes or items an operation scans counts as steps too, so that
    // a loop over a long string that measures it each time stays bounded.
    void charge(std::size_t work, std::uint32_t offset) {
        steps_ += work / 64;
        step(offset);
    }
    void check_size(std::size_t size, std::uint32_t offset) const {
        if (size > limits_.max_output_bytes) {
            fail("output larger than " + std::to_string(limits_.max_output_bytes) + " bytes",
                 offset);
        }
    }
    Value make_string(std::string s, std::uint32_t offset) const {
        check_size(s.size(), offset);
        return Value::string(std::move(s));
    }
    Value make_array(Array items, std::uint32_t offset) const {
        Value v = Value::array(std::move(items));
        check_nest(v, offset);
        return v;
    }
    Value make_object(std::shared_ptr<Object> o, std::uint32_t offset) const {
        o->build_index();
        Value v = Value::object(std::move(o));
        check_nest(v, offset);
        return v;
    }
    void check_nest(const Value& v, std::uint32_t offset) const {
        if (v.nest > static_cast<std::uint32_t>(2 * limits_.max_depth)) {
            fail("lists or dicts nested too deeply", offset);
        }
    }
    int value_depth() const { return 2 * limits_.max_depth + 8; }
    std::string display(const Value& v, std::uint32_t offset) const {
        try {
            return to_display(v, value_depth());
        } catch (const std::runtime_error& e) {
            fail(e.what(), offset);
        }
    }

    // ---- statements

    Flow exec(const Body& body, const std::shared_ptr<Scope>& scope, std::string& out) {
        for (const auto& s : body) {
            const Flow flow = exec(*s, scope, out);
            if (flow != Flow::normal) return flow;
        }
        return Flow::normal;
    }

    Flow exec(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string& out) {
        const NestGuard nest(nest_, s.offset);
        step(s.offset);
        switch (s.kind) {
            case Stmt::Kind::text:
                out += s.text;
                check_size(out.size(), s.offset);
                return Flow::normal;
            case Stmt::Kind::output: {
                const Value v = eval(*s.expr, *scope);
                if (v.is_string()) {
                    out += v.str();
                } else {
                    out += display(v, s.offset);
                }
                check_size(out.size(), s.offset);
                return Flow::normal;
            }
            case Stmt::Kind::if_:
                return exec(truthy(eval(*s.expr, *scope)) ? s.body : s.else_body, scope, out);
            case Stmt::Kind::for_:
                exec_for(s, scope, out);
                return Flow::normal;
            case Stmt::Kind::set:
                assign(*s.target, eval(*s.expr, *scope), *scope);
                return Flow::normal;
            case Stmt::Kind::set_block: {
                std::string text;
                exec(s.body, scope, text);
                assign(*s.target, Value::string(std::move(text)), *scope);
                return Flow::normal;
            }
            case Stmt::Kind::macro: {
                auto fn = std::make_shared<Callable>();
                fn->kind = Callable::Kind::macro;
                fn->name = s.name;
                fn->node = &s;
                fn->closure = scope;
                callables_.push_back(fn);
                Value v;
                v.kind = Kind::function;
                v.fn = std::move(fn);
                scope->set(s.name, std::move(v));
                return Flow::normal;
            }
            case Stmt::Kind::call_block: {
                const Expr& call = *s.expr;
                const Value callee = eval(*call.args[0], *scope);
                if (!callee.is(Kind::function) || callee.fn->kind != Callable::Kind::macro) {
                    fail("'call' needs a macro", s.offset);
                }
                Args args = eval_args(call, 1, *scope);
                auto caller = std::make_shared<Callable>();
                caller->kind = Callable::Kind::caller;
                caller->name = "caller";
                caller->node = &s;
                caller->closure = scope;
                callables_.push_back(caller);
                Value caller_value;
                caller_value.kind = Kind::function;
                caller_value.fn = std::move(caller);
                const Value result = invoke(*callee.fn, std::move(args), s.offset, &caller_value);
                out += result.str();
                check_size(out.size(), s.offset);
                return Flow::normal;
            }
            case Stmt::Kind::filter_block: {
                std::string text;
                exec(s.body, scope, text);
                const Value v = apply_filter(*s.expr, Value::string(std::move(text)), *scope);
                out += display(v, s.offset);
                check_size(out.size(), s.offset);
                return Flow::normal;
            }
            case Stmt::Kind::break_:
                return Flow::break_;
            case Stmt::Kind::continue_:
                return Flow::continue_;
        }
        return Flow::normal;
    }

    Array iterate(const Value& v, std::uint32_t offset) {
        charge(v.is_string() ? v.str().size() : v.is(Kind::array) ? v.a->size() : 0, offset);
        switch (v.kind) {
            case Kind::undefined:
                return {};
            case Kind::array:
                return *v.a;
            case Kind::object: {
                Array keys;
                for (const auto& [k, item] : v.o->items)
                    keys.push_back(Value::string(k));
                return keys;
            }
            case Kind::string: {
                Array chars;
                for (const auto cp : code_points(v.str()))
                    chars.push_back(Value::string(std::string(cp)));
                return chars;
            }
            default:
                fail(std::string("'") + type_name(v) + "' object is not iterable", offset);
        }
    }

    void exec_for(const Stmt& s, const std::shared_ptr<Scope>& outer, std::string& out) {
        auto scope = std::make_shared<Scope>();
        scope->parent = outer;
        Array items = iterate(eval(*s.expr, *scope), s.offset);
        if (s.cond) {
            Array kept;
            for (auto& item : items) {
                step(s.offset);
                assign(*s.target, item, *scope);
                if (truthy(eval(*s.cond, *scope))) kept.push_back(std::move(item));
            }
            items = std::move(kept);
        }
        const auto n = static_cast<std::int64_t>(items.size());
        for (std::int64_t k = 0; k < n; ++k) {
            step(s.offset);
            auto loop = std::make_shared<Object>();
            loop->items = {
                {"index", Value::integer(k + 1)},
                {"index0", Value::integer(k)},
                {"revindex", Value::integer(n - k)},
                {"revindex0", Value::integer(n - k - 1)},
                {"first", Value::boolean(k == 0)},
                {"last", Value::boolean(k == n - 1)},
                {"length", Value::integer(n)},
                {"previtem", k > 0 ? items[static_cast<std::size_t>(k - 1)] : Value{}},
                {"nextitem", k + 1 < n ? items[static_cast<std::size_t>(k + 1)] : Value{}},
                {"depth", Value::integer(1)},
                {"depth0", Value::integer(0)},
            };
            scope->set("loop", Value::object(std::move(loop)));
            assign(*s.target, items[static_cast<std::size_t>(k)], *scope);
            if (exec(s.body, scope, out) == Flow::break_) break;
        }
        if (n == 0) exec(s.else_body, scope, out);
    }

    void assign(const Expr& target, Value v, Scope& scope) {
        switch (target.kind) {
            case Expr::Kind::name:
                scope.set(target.name, std::move(v));
                return;
            case Expr::Kind::attr: {
                const Value object = eval(*target.args[0], scope);
                if (!object.is(Kind::ns)) {
                    fail("cannot assign attribute on non-namespace object", target.offset);
                }
                object.o->set(target.name, std::move(v));
                return;
            }
            case Expr::Kind::tuple: {
                if (!v.is(Kind::array)) {
                    fail(std::string("cannot unpack '") + type_name(v) + "'", target.offset);
                }
                if (v.a->size() != target.args.size()) {
                    fail("expected " + std::to_string(target.args.size()) +
                             " values to unpack, got " + std::to_string(v.a->size()),
                         target.offset);
                }
                for (std::size_t k = 0; k < target.args.size(); ++k)
                    assign(*target.args[k], (*v.a)[k], scope);
                return;
            }
            default:
                fail("cannot assign to this expression", target.offset);
        }
    }

    // ---- calls

    Value invoke(const Callable& fn, Args args, std::uint32_t offset,
                 const Value* caller = nullptr) {
        step(offset);
        if (++depth_ > limits_.max_depth) fail("macro calls nested too deeply", offset);
        struct Leave {
            int& d;
            ~Leave() { --d; }
        } leave{depth_};
        const Stmt& node = *fn.node;
        auto scope = std::make_shared<Scope>();
        scope->parent = fn.closure;
        if (args.pos.size() > node.params.size()) {
            fail("macro '" + fn.name + "' takes not more than " +
                     std::to_string(node.params.size()) + " argument(s)",
                 offset);
        }
        for (const auto& [k, v] : args.kw) {
            const bool known = std::any_of(node.params.begin(), node.params.end(),
                                           [&name = k](const Param& p) { return p.name == name; });
            if (!known)
                fail("macro '" + fn.name + "' takes no keyword argument '" + k + "'", offset);
        }
        for (std::size_t k = 0; k < node.params.size(); ++k) {
            const Param& param = node.params[k];
            const Value* given = args.get(k, param.name);
            if (given != nullptr) {
                scope->set(param.name, *given);
            } else if (param.default_value) {
                scope->set(param.name, eval(*param.default_value, *scope));
            } else {
                scope->set(param.name, undefined_named("'" + param.name + "' is undefined"));
            }
        }
        if (caller != nullptr) scope->set("caller", *caller);
        std::string out;
        exec(node.body, scope, out);
        return Value::string(std::move(out));
    }

    Args eval_args(const Expr& e, std::size_t first, Scope& scope) {
        Args args;
        for (std::size_t k = first; k < e.args.size(); ++k)
            args.pos.push_back(eval(*e.args[k], scope));
        for (const auto& [k, v] : e.kwargs)
            args.kw.emplace_back(k, eval(*v, scope));
        return args;
    }

    Value call(const Expr& e, Scope& scope) {
        const Expr& callee = *e.args[0];
        if (callee.kind == Expr::Kind::attr) {
            const Value object = eval(*callee.args[0], scope);
            Args args = eval_args(e, 1, scope);
            return call_method(object, callee.name, args, e.offset);
        }
        // A name: a macro, caller, or a global function.
        const Value* v = scope.find(callee.name);
        Args args = eval_args(e, 1, scope);
        if (v != nullptr && v->is(Kind::function)) {
            const Callable& fn = *v->fn;
            if (fn.kind == Callable::Kind::global) return call_global(fn.name, args, e.offset);
            return invoke(fn, std::move(args), e.offset);
        }
        if (v != nullptr) fail("'" + callee.name + "' is not callable", callee.offset);
        return call_global(callee.name, args, callee.offset);
    }

    Value call_global(const std::string& name, const Args& args, std::uint32_t offset) {
        if (name == "raise_exception") {
            const Value* message = args.get(0, "message");
            throw RaisedError(message ? display(*message, offset) : std::string("raise_exception"));
        }
        if (name == "namespace" || name == "dict") {
            auto o = std::make_shared<Object>();
            if (!args.pos.empty()) {
                if (args.pos.size() > 1 || !args.pos[0].is_mapping()) {
                    fail(name + "() takes a dict or keyword arguments", offset);
                }
                o->items = args.pos[0].o->items;
            }
            for (const auto& [k, v] : args.kw)
                o->set(k, v);
            if (name == "dict") return make_object(std::move(o), offset);
            namespaces_.push_back(o);
            return Value::object(std::move(o), Kind::ns);
        }
        if (name == "range") {
            std::int64_t start = 0, stop = 0, stride = 1;
            std::vector<std::int64_t> ints;
            for (const auto& a : args.pos) {
                if (!a.is(Kind::integer)) fail("range() takes integers", offset);
                ints.push_back(a.i);
            }
            if (ints.size() == 1) {
                stop = ints[0];
            } else if (ints.size() == 2 || ints.size() == 3) {
                start = ints[0];
                stop = ints[1];
                if (ints.size() == 3) stride = ints[2];
            } else {
                fail("range() takes 1 to 3 arguments", offset);
            }
            if (stride == 0) fail("range() step must not be zero", offset);
            Array out;
            for (std::int64_t x = start; stride > 0 ? x < stop : x > stop; x += stride) {
                if (out.size() >= 100000) fail("range() longer than 100000", offset);
                out.push_back(Value::integer(x));
            }
            return Value::array(std::move(out));
        }
        if (name == "strftime_now") {
            const Value* format = args.get(0, "format");
            if (format == nullptr || !format->is_string())
                fail("strftime_now() takes a format string", offset);
            const std::time_t now = std::time(nullptr);
            std::tm local{};
            localtime_r(&now, &local);
            char buf[256];
            const std::size_t n = std::strftime(buf, sizeof buf, format->str().c_str(), &local);
            return Value::string(std::string(buf, n));
        }
        fail("'" + name + "' is undefined", offset);
    }

    Value call_method(const Value& object, const std::string& name, const Args& args,
                      std::uint32_t offset) {
        if (object.is_string()) return string_method(object.str(), name, args, offset);
        if (object.is_mapping()) {
            const Object& o = *object.o;
            if (name == "items") return items_of(object, offset);
            if (name == "keys" || name == "values") {
                Array out;
                for (const auto& [k, v] : o.items)
                    out.push_back(name == "keys" ? Value::string(k) : v);
                return Value::array(std::move(out));
            }
            if (name == "get") {
                const Value* key = args.get(0, "key");
                const Value* fallback = args.get(1, "default");
                if (key == nullptr) fail("get() takes a key", offset);
                const Value* found = key->is_string() ? o.find(key->str()) : nullptr;
                if (found != nullptr) return *found;
                return fallback != nullptr ? *fallback : Value::none();
            }
        }
        if (object.is_undefined()) fail(describe_undefined(object), offset);
        fail(std::string("'") + type_name(object) + "' object has no method '" + name + "'",
             offset);
    }

    Value items_of(const Value& object, std::uint32_t offset) {
        if (object.is_undefined()) return Value::array({});
        if (!object.is_mapping())
            fail(std::string("'") + type_name(object) + "' has no items", offset);
        Array out;
        for (const auto& [k, v] : object.o->items)
            out.push_back(Value::array({Value::string(k), v}));
        return make_array(std::move(out), offset);
    }

    static std::string need_string(const Value* v, const char* what, std::uint32_t offset) {
        if (v == nullptr || !v->is_string()) fail(std::string(what) + " must be a string", offset);
        return v->str();
    }

    Value string_method(const std::string& s, const std::string& name, const Args& args,
                        std::uint32_t offset) {
        charge(s.size(), offset);
        if (name == "strip" || name == "lstrip" || name == "rstrip") {
            const Value* chars = args.get(0, "chars");
            if (chars != nullptr && !chars->is_string() && !chars->is_none()) {
                fail(name + " arg must be None or str", offset);
            }
            return Value::string(
                std::string(trim_set(s, chars, name != "rstrip", name != "lstrip")));
        }
        if (name == "startswith" || name == "endswith") {
            const Value* arg = args.get(0, "prefix");
            if (arg == nullptr) fail(name + "() takes an argument", offset);
            const auto test = [&](const Value& p) {
                if (!p.is_string()) fail(name + "() takes strings", offset);
                return name == "startswith" ? std::string_view(s).starts_with(p.str())
                                            : std::string_view(s).ends_with(p.str());
            };
            if (arg->is(Kind::array)) {
                return Value::boolean(std::any_of(arg->a->begin(), arg->a->end(), test));
            }
            return Value::boolean(test(*arg));
        }
        if (name == "split") return split(s, args, offset);
        if (name == "replace") {
            const std::string old = need_string(args.get(0, "old"), "replace() old", offset);
            const std::string repl = need_string(args.get(1, "new"), "replace() new", offset);
            const Value* count_arg = args.get(2, "count");
            std::int64_t count = -1;
            if (count_arg != nullptr) {
                if (!count_arg->is(Kind::integer))
                    fail("replace() count must be an integer", offset);
                count = count_arg->i;
            }
            return make_string(replace(s, old, repl, count), offset);
        }
        if (name == "upper" || name == "lower") {
            std::string r = s;
            for (auto& c : r)
                c = name == "upper" ? ascii_upper(c) : ascii_lower(c);
            return Value::string(std::move(r));
        }
        if (name == "capitalize" || name == "title")
            return Value::string(recase(s, name == "title"));
        if (name == "find" || name == "count") {
            const std::string sub = need_string(args.get(0, "sub"), name.c_str(), offset);
            if (name == "find") {
                const std::size_t at = s.find(sub);
                if (at == std::string::npos) return Value::integer(-1);
                return Value::integer(
                    static_cast<std::int64_t>(code_points(s.substr(0, at)).size()));
            }
            if (sub.empty())
                return Value::integer(static_cast<std::int64_t>(code_points(s).size()) + 1);
            std::int64_t n = 0;
            for (std::size_t at = s.find(sub); at != std::string::npos;
                 at = s.find(sub, at + sub.size()))
                ++n;
            return Value::integer(n);
        }
        if (name == "join") {
            const Value* items = args.get(0, "iterable");
            if (items == nullptr) fail("join() takes an iterable", offset);
            std::string out;
            bool first = true;
            for (const auto& item : iterate(*items, offset)) {
                if (!item.is_string()) fail("join() takes strings", offset);
                if (!first) out += s;
                first = false;
                out += item.str();
                check_size(out.size(), offset);
            }
            return Value::string(std::move(out));
        }
        fail("'str' object has no method '" + name + "'", offset);
    }

    static std::string recase(const std::string& s, bool title) {
        std::string r = s;
        bool start = true;
        for (auto& c : r) {
            const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
            if (title) {
                c = start ? ascii_upper(c) : ascii_lower(c);
                start =
                    !alpha && !(c >= '0' && c <= '9') && !(static_cast<unsigned char>(c) & 0x80);
            } else {
                c = start ? ascii_upper(c) : ascii_lower(c);
                start = false;
            }
        }
        return r;
    }

    std::string replace(const std::string& s, const std::string& old, const std::string& repl,
                        std::int64_t count) const {
        std::string out;
        if (old.empty()) {
            const auto cps = code_points(s);
            std::int64_t done = 0;
            for (std::size_t k = 0; k <= cps.size(); ++k) {
                if (count < 0 || done < count) {
                    out += repl;
                    ++done;
                }
                if (k < cps.size()) out += cps[k];
                check_size(out.size(), 0);
            }
            return out;
        }
        std::size_t pos = 0;
        std::int64_t done = 0;
        while (count < 0 || done < count) {
            const std::size_t at = s.find(old, pos);
            if (at == std::string::npos) break;
            out.append(s, pos, at - pos);
            out += repl;
            check_size(out.size(), 0);
            pos = at + old.size();
            ++done;
        }
        out.append(s, pos, std::string::npos);
        return out;
    }

    Value split(const std::string& s, const Args& args, std::uint32_t offset) const {
        const Value* sep = args.get(0, "sep");
        const Value* max_arg = args.get(1, "maxsplit");
        std::int64_t maxsplit = -1;
        if (max_arg != nullptr) {
            if (!max_arg->is(Kind::integer)) fail("split() maxsplit must be an integer", offset);
            maxsplit = max_arg->i;
        }
        Array parts;
        if (sep == nullptr || sep->is_none()) {
            // Runs of whitespace separate; no empty strings at the ends.
            std::size_t pos = 0;
            const auto skip_space = [&](std::size_t p) {
                while (p < s.size()) {
                    std::size_t next = p;
                    if (!is_python_space(decode_at(s, next))) break;
                    p = next;
                }
                return p;
            };
            pos = skip_space(pos);
            while (pos < s.size()) {
                if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) >= maxsplit) {
                    std::string_view rest(s);
                    rest = rest.substr(pos);
                    parts.push_back(Value::string(std::string(rest)));  // keeps trailing spaces
                    break;
                }
                std::size_t end = pos;
                while (end < s.size()) {
                    std::size_t next = end;
                    if (is_python_space(decode_at(s, next))) break;
                    end = next;
                }
                parts.push_back(Value::string(s.substr(pos, end - pos)));
                pos = skip_space(end);
            }
            return Value::array(std::move(parts));
        }
        if (!sep->is_string()) fail("split() sep must be a string", offset);
        const std::string& d = sep->str();
        if (d.empty()) fail("empty separator", offset);
        std::size_t pos = 0;
        while (true) {
            if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) >= maxsplit) break;
            const std::size_t at = s.find(d, pos);
            if (at == std::string::npos) break;
            parts.push_back(Value::string(s.substr(pos, at - pos)));
            pos = at + d.size();
        }
        parts.push_back(Value::string(s.substr(pos)));
        return Value::array(std::move(parts));
    }

    // ---- expressions

    // Every statement and expression being evaluated counts: macro calls (max_depth) times
    // the parser's nesting would otherwise recurse deep enough to overflow the stack (found by
    // tests/fuzz, fuzz_chat_template_compile: a recursive macro around `++++...x`).
    static constexpr int kMaxEvalNesting = 1000;
    struct NestGuard {
        int& n;
        NestGuard(int& nest, std::uint32_t offset) : n(nest) {
            if (++n > kMaxEvalNesting) {
                --n;
                fail("template nested too deeply when rendered", offset);
            }
        }
        ~NestGuard() { --n; }
        NestGuard(const NestGuard&) = delete;
        NestGuard& operator=(const NestGuard&) = delete;
    };

    Value eval(const Expr& e, Scope& scope) {
        const NestGuard nest(nest_, e.offset);
        switch (e.kind) {
            case Expr::Kind::literal:
                return e.value;
            case Expr::Kind::name: {
                const Value* v = scope.find(e.name);
                if (v != nullptr) return *v;
                if (is_supported_global(e.name)) {
                    auto fn = std::make_shared<Callable>();
                    fn->kind = Callable::Kind::global;
                    fn->name = e.name;
                    Value g;
                    g.kind = Kind::function;
                    g.fn = std::move(fn);
                    return g;
                }
                return undefined_named("'" + e.name + "' is undefined");
            }
            case Expr::Kind::list:
            case Expr::Kind::tuple: {
                Array items;
                for (const auto& a : e.args)
                    items.push_back(eval(*a, scope));
                return make_array(std::move(items), e.offset);
            }
            case Expr::Kind::dict: {
                auto o = std::make_shared<Object>();
                for (std::size_t k = 0; k + 1 < e.args.size(); k += 2) {
                    const Value key = eval(*e.args[k], scope);
                    if (!key.is_string()) fail("dict keys must be strings here", e.args[k]->offset);
                    o->set(key.str(), eval(*e.args[k + 1], scope));
                }
                return make_object(std::move(o), e.offset);
            }
            case Expr::Kind::attr:
                return get_attr(eval(*e.args[0], scope), e.name, e.offset);
            case Expr::Kind::item:
                return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope), e.offset);
            case Expr::Kind::slice:
                return slice(e, scope);
            case Expr::Kind::call:
                return call(e, scope);
            case Expr::Kind::filter:
                return apply_filter(e, eval(*e.args[0], scope), scope);
            case Expr::Kind::test: {
                const Value operand = eval(*e.args[0], scope);
                Args args = eval_args(e, 1, scope);
                const bool result = run_test(e.name, operand, args, e.offset);
                return Value::boolean(e.negate ? !result : result);
            }
            case Expr::Kind::neg:
            case Expr::Kind::pos: {
                const Value v = eval(*e.args[0], scope);
                const bool neg = e.kind == Expr::Kind::neg;
                if (v.is(Kind::integer)) {
                    if (neg && v.i == INT64_MIN) fail("integer overflow", e.offset);
                    return Value::integer(neg ? -v.i : v.i);
                }
                if (v.is(Kind::boolean)) return Value::integer(neg ? -std::int64_t{v.b} : v.b);
                if (v.is(Kind::floating)) return Value::floating(neg ? -v.f : v.f);
                fail(std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" +
                         type_name(v) + "'",
                     e.offset);
            }
            case Expr::Kind::not_:
                return Value::boolean(!truthy(eval(*e.args[0], scope)));
            case Expr::Kind::and_: {
                Value left = eval(*e.args[0], scope);
                return truthy(left) ? eval(*e.args[1], scope) : left;
            }
            case Expr::Kind::or_: {
                Value left = eval(*e.args[0], scope);
                return truthy(left) ? left : eval(*e.args[1], scope);
            }
            case Expr::Kind::binary:
                return binary(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope), e.offset);
            case Expr::Kind::compare: {
                Value left = eval(*e.args[0], scope);
                for (std::size_t k = 0; k < e.ops.size(); ++k) {
                    Value right = eval(*e.args[k + 1], scope);
                    if (!compare(e.ops[k], left, right, e.offset)) return Value::boolean(false);
                    left = std::move(right);
                }
                return Value::boolean(true);
            }
            case Expr::Kind::cond:
                if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
                if (e.args[2]) return eval(*e.args[2], scope);
                return Value{};
        }
        return Value{};
    }

    Value get_attr(const Value& object, const std::string& name, std::uint32_t offset) {
        switch (object.kind) {
            case Kind::undefined:
                fail(describe_undefined(object), offset);
            case Kind::object:
            case Kind::ns: {
                const Value* v = object.o->find(name);
                if (v != nullptr) return *v;
                return undefined_named(std::string("'") +
                                       (object.is(Kind::ns) ? "namespace" : "dict") +
                                       " object' has no attribute '" + name + "'");
            }
            default:
                return undefined_named(std::string("'") + type_name(object) +
                                       " object' has no attribute '" + name + "'");
        }
    }

    static std::int64_t wrap_index(std::int64_t index, std::size_t size) {
        return index < 0 ? index + static_cast<std::int64_t>(size) : index;
    }

    Value get_item(const Value& object, const Value& key, std::uint32_t offset) {
        const auto missing = [&] {
            return undefined_named(std::string("'") + type_name(object) + " object' has no item " +
                                   to_repr(key, 4));
        };
        std::int64_t index = 0;
        const bool int_key = key.is(Kind::integer) || key.is(Kind::boolean);
        if (int_key) index = key.is(Kind::boolean) ? key.b : key.i;
        switch (object.kind) {
            case Kind::undefined:
                fail(describe_undefined(object), offset);
            case Kind::array: {
                if (!int_key) return missing();
                index = wrap_index(index, object.a->size());
                if (index < 0 || index >= static_cast<std::int64_t>(object.a->size()))
                    return missing();
                return (*object.a)[static_cast<std::size_t>(index)];
            }
            case Kind::string: {
                if (!int_key) return missing();
                charge(object.str().size(), offset);
                const auto cps = code_points(object.str());
                index = wrap_index(index, cps.size());
                if (index < 0 || index >= static_cast<std::int64_t>(cps.size())) return missing();
                return Value::string(std::string(cps[static_cast<std::size_t>(index)]));
            }
            case Kind::object:
            case Kind::ns: {
                if (!key.is_string()) return missing();
                const Value* v = object.o->find(key.str());
                return v != nullptr ? *v : missing();
            }
            default:
                return missing();
        }
    }

    Value slice(const Expr& e, Scope& scope) {
        const Value object = eval(*e.args[0], scope);
        std::int64_t bound[3] = {0, 0, 1};
        bool given[3] = {false, false, false};
        for (int k = 0; k < 3; ++k) {
            if (!e.args[static_cast<std::size_t>(k + 1)]) continue;
            const Value v = eval(*e.args[static_cast<std::size_t>(k + 1)], scope);
            if (v.is_none() || v.is_undefined()) continue;
            if (!v.is(Kind::integer)) fail("slice indices must be integers", e.offset);
            bound[k] = v.i;
            given[k] = true;
        }
        const std::int64_t stride = given[2] ? bound[2] : 1;
        if (stride == 0) fail("slice step cannot be zero", e.offset);
        std::vector<std::string_view> cps;
        std::size_t size = 0;
        if (object.is(Kind::array)) {
            size = object.a->size();
        } else if (object.is_string()) {
            charge(object.str().size(), e.offset);
            cps = code_points(object.str());
            size = cps.size();
        } else if (object.is_undefined()) {
            fail(describe_undefined(object), e.offset);
        } else {
            fail(std::string("'") + type_name(object) + "' object cannot be sliced", e.offset);
        }
        const auto n = static_cast<std::int64_t>(size);
        const auto clamp = [&](std::int64_t v, std::int64_t lo, std::int64_t hi) {
            if (v < 0) v += n;
            return std::clamp(v, lo, hi);
        };
        std::int64_t start, stop;
        if (stride > 0) {
            start = given[0] ? clamp(bound[0], 0, n) : 0;
            stop = given[1] ? clamp(bound[1], 0, n) : n;
        } else {
            start = given[0] ? clamp(bound[0], -1, n - 1) : n - 1;
            stop = given[1] ? clamp(bound[1], -1, n - 1) : -1;
        }
        Array items;
        std::string text;
        for (std::int64_t k = start; stride > 0 ? k < stop : k > stop; k += stride) {
            if (object.is(Kind::array)) {
                items.push_back((*object.a)[static_cast<std::size_t>(k)]);
            } else {
                text += cps[static_cast<std::size_t>(k)];
            }
        }
        if (object.is(Kind::array)) return Value::array(std::move(items));
        return Value::string(std::move(text));
    }

    bool less(const Value& a, const Value& b, std::uint32_t offset) {
        if (a.is_string() && b.is_string()) return a.str() < b.str();
        const auto num = [](const Value& v, double& out) {
            if (v.is(Kind::integer))
                out = static_cast<double>(v.i);
            else if (v.is(Kind::floating))
                out = v.f;
            else if (v.is(Kind::boolean))
                out = v.b;
            else
                return false;
            return true;
        };
        double x = 0, y = 0;
        if (a.is(Kind::integer) && b.is(Kind::integer)) return a.i < b.i;
        if (num(a, x) && num(b, y)) return x < y;
        if (a.is_undefined()) fail(describe_undefined(a), offset);
        if (b.is_undefined()) fail(describe_undefined(b), offset);
        fail(std::string("'<' not supported between '") + type_name(a) + "' and '" + type_name(b) +
                 "'",
             offset);
    }

    bool contains(const Value& container, const Value& item, std::uint32_t offset) {
        charge(container.is_string()       ? container.str().size()
               : container.is(Kind::array) ? container.a->size()
                                           : 0,
               offset);
        switch (container.kind) {
            case Kind::undefined:
                return false;
            case Kind::string:
                if (!item.is_string()) {
                    fail(std::string("'in <string>' requires string as left operand, not ") +
                             type_name(item),
                         offset);
                }
                return container.str().find(item.str()) != std::string::npos;
            case Kind::array:
                return std::any_of(container.a->begin(), container.a->end(),
                                   [&](const Value& v) { return equal(v, item, value_depth()); });
            case Kind::object:
            case Kind::ns:
                return item.is_string() && container.o->find(item.str()) != nullptr;
            default:
                fail(std::string("argument of type '") + type_name(container) + "' is not iterable",
                     offset);
        }
    }

    bool compare(const std::string& op, const Value& a, const Value& b, std::uint32_t offset) {
        if (a.is(Kind::array) && b.is(Kind::array)) charge(a.a->size(), offset);
        try {
            if (op == "==") return equal(a, b, value_depth());
            if (op == "!=") return !equal(a, b, value_depth());
        } catch (const std::runtime_error& err) {
            fail(err.what(), offset);
        }
        if (op == "<") return less(a, b, offset);
        if (op == ">") return less(b, a, offset);
        if (op == "<=") return !less(b, a, offset);
        if (op == ">=") return !less(a, b, offset);
        if (op == "in") return contains(b, a, offset);
        if (op == "not in") return !contains(b, a, offset);
        fail("unknown comparison " + op, offset);
    }

    Value binary(const std::string& op, const Value& a, const Value& b, std::uint32_t offset) {
        if (a.is_string() && b.is_string()) charge(a.str().size() + b.str().size(), offset);
        if (a.is(Kind::array) && b.is(Kind::array)) charge(a.a->size() + b.a->size(), offset);
        if (op == "~") return make_string(display(a, offset) + display(b, offset), offset);
        if (a.is_undefined()) fail(describe_undefined(a), offset);
        if (b.is_undefined()) fail(describe_undefined(b), offset);
        const auto type_error = [&]() {
            fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                     type_name(b) + "'",
                 offset);
        };
        const auto is_int = [](const Value& v) {
            return v.is(Kind::integer) || v.is(Kind::boolean);
        };
        const auto as_int = [](const Value& v) {
            return v.is(Kind::boolean) ? std::int64_t{v.b} : v.i;
        };
        const auto is_num = [&](const Value& v) { return is_int(v) || v.is(Kind::floating); };
        const auto as_float = [&](const Value& v) {
            return v.is(Kind::floating) ? v.f : static_cast<double>(as_int(v));
        };
        if (op == "+") {
            if (a.is_string() && b.is_string()) {
                check_size(a.str().size() + b.str().size(), offset);
                return Value::string(a.str() + b.str());
            }
            if (a.is(Kind::array) && b.is(Kind::array)) {
                check_size(a.a->size() + b.a->size(), offset);
                Array items = *a.a;
                items.insert(items.end(), b.a->begin(), b.a->end());
                return Value::array(std::move(items));
            }
        }
        if (op == "*") {
            const Value& seq = is_int(a) ? b : a;
            const Value& times = is_int(a) ? a : b;
            if (is_int(times) && (seq.is_string() || seq.is(Kind::array))) {
                const std::int64_t n = std::max<std::int64_t>(0, as_int(times));
                const std::size_t unit = seq.is_string() ? seq.str().size() : seq.a->size();
                if (unit != 0 && static_cast<std::uint64_t>(n) > limits_.max_output_bytes / unit) {
                    check_size(limits_.max_output_bytes + 1, offset);
                }
                if (seq.is_string()) {
                    std::string r;
                    for (std::int64_t k = 0; k < n; ++k)
                        r += seq.str();
                    return Value::string(std::move(r));
                }
                Array items;
                for (std::int64_t k = 0; k < n; ++k)
                    items.insert(items.end(), seq.a->begin(), seq.a->end());
                return Value::array(std::move(items));
            }
        }
        if (!is_num(a) || !is_num(b)) type_error();
        if (is_int(a) && is_int(b)) {
            const std::int64_t x = as_int(a), y = as_int(b);
            std::int64_t r = 0;
            if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value::integer(r);
            if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value::integer(r);
            if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value::integer(r);
            if (op == "//" || op == "%") {
                if (y == 0) fail("integer division or modulo by zero", offset);
                if (x == INT64_MIN && y == -1) fail("integer overflow", offset);
                std::int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) {
                    --q;
                    m += y;
                }
                return Value::integer(op == "//" ? q : m);
            }
            if (op == "**" && y >= 0) {
                std::int64_t acc = 1, base = x;
                bool overflow = false;
                for (std::int64_t e = y; e > 0 && !overflow; e >>= 1) {
                    if (e & 1) overflow = __builtin_mul_overflow(acc, base, &acc);
                    if (e > 1 && !overflow) overflow = __builtin_mul_overflow(base, base, &base);
                }
                if (!overflow) return Value::integer(acc);
            }
            if (op == "+" || op == "-" || op == "*" || (op == "**" && y >= 0)) {
                fail("integer overflow", offset);
            }
        }
        const double x = as_float(a), y = as_float(b);
        if (op == "+") return Value::floating(x + y);
        if (op == "-") return Value::floating(x - y);
        if (op == "*") return Value::floating(x * y);
        if (op == "/") {
            if (y == 0) fail("division by zero", offset);
            return Value::floating(x / y);
        }
        if (op == "//" || op == "%") {
            if (y == 0) fail("float division by zero", offset);
            const double m = std::fmod(x, y);
            const double mod = (m != 0 && ((m < 0) != (y < 0))) ? m + y : m;
            return Value::floating(op == "%" ? mod : std::floor(x / y));
        }
        if (op == "**") return Value::floating(std::pow(x, y));
        type_error();
        return Value{};
    }

    // ---- tests and filters

    bool run_test(const std::string& name, const Value& v, const Args& args, std::uint32_t offset) {
        const Value* arg = args.get(0, "value");
        const auto need_arg = [&]() -> const Value& {
            if (arg == nullptr) fail("test '" + name + "' takes an argument", offset);
            return *arg;
        };
        if (name == "defined") return !v.is_undefined();
        if (name == "undefined") return v.is_undefined();
        if (name == "none") return v.is_none();
        if (name == "boolean") return v.is(Kind::boolean);
        if (name == "false") return v.is(Kind::boolean) && !v.b;
        if (name == "true") return v.is(Kind::boolean) && v.b;
        if (name == "integer") return v.is(Kind::integer);
        if (name == "float") return v.is(Kind::floating);
        if (name == "number") return v.is_number() || v.is(Kind::boolean);
        if (name == "string") return v.is_string();
        if (name == "mapping") return v.is_mapping();
        if (name == "callable") return v.is(Kind::function);
        if (name == "iterable" || name == "sequence") {
            return v.is_string() || v.is(Kind::array) || v.is_mapping() || v.is_undefined();
        }
        if (name == "lower" || name == "upper") {
            if (!v.is_string()) return false;
            return std::none_of(v.str().begin(), v.str().end(), [&](char c) {
                return name == "lower" ? (c >= 'A' && c <= 'Z') : (c >= 'a' && c <= 'z');
            });
        }
        if (name == "odd" || name == "even" || name == "divisibleby") {
            if (!v.is(Kind::integer)) fail("test '" + name + "' needs an integer", offset);
            std::int64_t d = 2;
            if (name == "divisibleby") {
                const Value& n = need_arg();
                if (!n.is(Kind::integer) || n.i == 0)
                    fail("divisibleby needs a nonzero integer", offset);
                d = n.i;
            }
            const std::int64_t m = (d == -1) ? 0 : v.i % d;
            return name == "odd" ? m != 0 : m == 0;
        }
        if (name == "eq" || name == "equalto") return compare("==", v, need_arg(), offset);
        if (name == "ne") return compare("!=", v, need_arg(), offset);
        if (name == "lt") return compare("<", v, need_arg(), offset);
        if (name == "le") return compare("<=", v, need_arg(), offset);
        if (name == "gt") return compare(">", v, need_arg(), offset);
        if (name == "ge") return compare(">=", v, need_arg(), offset);
        if (name == "in") return contains(need_arg(), v, offset);
        if (name == "sameas") {
            const Value& other = need_arg();
            if (v.kind != other.kind) return false;
            switch (v.kind) {
                case Kind::none:
                case Kind::undefined:
                    return true;
                case Kind::boolean:
                    return v.b == other.b;
                case Kind::string:
                    return v.s == other.s;
                case Kind::array:
                    return v.a == other.a;
                case Kind::object:
                case Kind::ns:
                    return v.o == other.o;
                default:
                    return equal(v, other, 2);
            }
        }
        fail("unsupported test '" + name + "'", offset);
    }

    // The items of `v` for filters over sequences (a dict gives its keys, undefined nothing).
    Array sequence_of(const Value& v, const std::string& filter, std::uint32_t offset) {
        if (v.is_none()) fail("filter '" + filter + "' cannot take None", offset);
        return iterate(v, offset);
    }

    // attribute lookup of map/selectattr/sort: "a.b.0"
    Value attribute_path(const Value& item, const std::string& path, std::uint32_t offset) {
        Value v = item;
        std::size_t pos = 0;
        while (pos <= path.size()) {
            const std::size_t dot = std::min(path.find('.', pos), path.size());
            const std::string part = path.substr(pos, dot - pos);
            std::int64_t index = 0;
            const auto res = std::from_chars(part.data(), part.data() + part.size(), index);
            if (v.is_undefined()) return v;
            if (res.ec == std::errc{} && res.ptr == part.data() + part.size() &&
                v.is(Kind::array)) {
                v = get_item(v, Value::integer(index), offset);
            } else {
                v = get_item(v, Value::string(part), offset);
            }
            pos = dot + 1;
        }
        return v;
    }

    Value apply_filter(const Expr& f, Value v, Scope& scope) {
        Args args = eval_args(f, 1, scope);
        return filter(f.name, std::move(v), args, f.offset);
    }

    Value filter(const std::string& name, Value v, const Args& args, std::uint32_t offset) {
        charge(v.is_string() ? v.str().size() : v.is(Kind::array) ? v.a->size() : 0, offset);
        if (name == "safe") return v;
        if (name == "default" || name == "d") {
            const Value* fallback = args.get(0, "default_value");
            const Value* boolean = args.get(1, "boolean");
            const bool use =
                v.is_undefined() || (boolean != nullptr && truthy(*boolean) && !truthy(v));
            if (!use) return v;
            return fallback != nullptr ? *fallback : Value::string({});
        }
        if (name == "tojson") return tojson(v, args, offset);
        if (name == "string") return v.is_string() ? v : make_string(display(v, offset), offset);
        if (name == "length" || name == "count") {
            switch (v.kind) {
                case Kind::undefined:
                    return Value::integer(0);
                case Kind::string:
                    return Value::integer(static_cast<std::int64_t>(code_points(v.str()).size()));
                case Kind::array:
                    return Value::integer(static_cast<std::int64_t>(v.a->size()));
                case Kind::object:
                case Kind::ns:
                    return Value::integer(static_cast<std::int64_t>(v.o->items.size()));
                default:
                    fail(std::string("object of type '") + type_name(v) + "' has no len()", offset);
            }
        }
        if (name == "items") return items_of(v, offset);
        if (name == "list") return make_array(sequence_of(v, name, offset), offset);
        if (name == "first" || name == "last") {
            Array items = sequence_of(v, name, offset);
            if (items.empty()) return undefined_named("no " + name + " item of an empty sequence");
            return name == "first" ? items.front() : items.back();
        }
        if (name == "reverse") {
            if (v.is_string()) {
                auto cps = code_points(v.str());
                std::string r;
                for (auto it = cps.rbegin(); it != cps.rend(); ++it)
                    r += *it;
                return Value::string(std::move(r));
            }
            Array items = sequence_of(v, name, offset);
            std::reverse(items.begin(), items.end());
            return Value::array(std::move(items));
        }
        if (name == "join") {
            const Value* sep = args.get(0, "d");
            const Value* attribute = args.get(1, "attribute");
            std::string out;
            bool first = true;
            for (const auto& item : sequence_of(v, name, offset)) {
                if (!first && sep != nullptr) out += display(*sep, offset);
                first = false;
                out += display(
                    attribute ? attribute_path(item, display(*attribute, offset), offset) : item,
                    offset);
                check_size(out.size(), offset);
            }
            return Value::string(std::move(out));
        }
        if (name == "trim") {
            if (!v.is_string()) fail("filter 'trim' needs a string", offset);
            return Value::string(std::string(trim_set(v.str(), args.get(0, "chars"), true, true)));
        }
        if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
            const std::string s = v.is_string() ? v.str() : display(v, offset);
            return string_method(s, name, Args{}, offset);
        }
        if (name == "replace") {
            if (!v.is_string()) fail("filter 'replace' needs a string", offset);
            return string_method(v.str(), "replace", args, offset);
        }
        if (name == "int" || name == "float") return to_number(name, v, args);
        if (name == "abs") {
            if (v.is(Kind::integer)) {
                if (v.i == INT64_MIN) fail("integer overflow", offset);
                return Value::integer(v.i < 0 ? -v.i : v.i);
            }
            if (v.is(Kind::floating)) return Value::floating(std::fabs(v.f));
            fail(std::string("bad operand type for abs(): '") + type_name(v) + "'", offset);
        }
        if (name == "indent") return indent(v, args, offset);
        if (name == "unique") {
            Array out;
            for (auto& item : sequence_of(v, name, offset)) {
                const bool seen = std::any_of(out.begin(), out.end(), [&](const Value& o) {
                    return equal(o, item, value_depth());
                });
                if (!seen) out.push_back(std::move(item));
            }
            return Value::array(std::move(out));
        }
        if (name == "sort" || name == "dictsort") return sort(name, v, args, offset);
        if (name == "map") {
            Array out;
            const Value* attribute = args.get(99, "attribute");
            for (const auto& item : sequence_of(v, name, offset)) {
                step(offset);
                if (attribute != nullptr) {
                    Value got = attribute_path(item, display(*attribute, offset), offset);
                    const Value* fallback = args.get(99, "default");
                    out.push_back(got.is_undefined() && fallback ? *fallback : got);
                } else {
                    if (args.pos.empty() || !args.pos[0].is_string())
                        fail("map() needs a filter name or attribute=", offset);
                    const std::string& inner = args.pos[0].str();
                    if (!is_supported_filter(inner) || inner == "map")
                        fail("unsupported filter '" + inner + "'", offset);
                    Args rest;
                    rest.pos.assign(args.pos.begin() + 1, args.pos.end());
                    rest.kw = args.kw;
                    out.push_back(filter(inner, item, rest, offset));
                }
            }
            return make_array(std::move(out), offset);
        }
        if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
            const bool by_attr = name == "selectattr" || name == "rejectattr";
            const bool keep_if = name == "select" || name == "selectattr";
            std::size_t k = 0;
            std::string attr;
            if (by_attr) {
                if (args.pos.empty() || !args.pos[0].is_string())
                    fail(name + "() needs an attribute name", offset);
                attr = args.pos[0].str();
                k = 1;
            }
            std::string test;
            Args test_args;
            if (k < args.pos.size()) {
                if (!args.pos[k].is_string()) fail(name + "() needs a test name", offset);
                test = args.pos[k].str();
                if (!is_supported_test(test)) fail("unsupported test '" + test + "'", offset);
                test_args.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(k + 1),
                                     args.pos.end());
            }
            Array out;
            for (auto& item : sequence_of(v, name, offset)) {
                step(offset);
                const Value subject = by_attr ? attribute_path(item, attr, offset) : item;
                const bool pass =
                    test.empty() ? truthy(subject) : run_test(test, subject, test_args, offset);
                if (pass == keep_if) out.push_back(std::move(item));
            }
            return Value::array(std::move(out));
        }
        fail("unsupported filter '" + name + "'", offset);
    }

    Value tojson(const Value& v, const Args& args, std::uint32_t offset) {
        // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None,
        // sort_keys=False)
        JsonOptions options;
        const Value* ensure_ascii = args.get(0, "ensure_ascii");
        const Value* indent = args.get(1, "indent");
        const Value* separators = args.get(2, "separators");
        const Value* sort_keys = args.get(3, "sort_keys");
        if (ensure_ascii != nullptr) options.ensure_ascii = truthy(*ensure_ascii);
        if (sort_keys != nullptr) options.sort_keys = truthy(*sort_keys);
        if (indent != nullptr && !indent->is_none()) {
            if (!indent->is(Kind::integer) || indent->i < 0 || indent->i > 64) {
                fail("tojson indent must be a small integer", offset);
            }
            options.indent = static_cast<int>(indent->i);
            options.item_separator = ",";
        }
        if (separators != nullptr && !separators->is_none()) {
            if (!separators->is(Kind::array) || separators->a->size() != 2 ||
                !(*separators->a)[0].is_string() || !(*separators->a)[1].is_string()) {
                fail("tojson separators must be two strings", offset);
            }
            options.item_separator = (*separators->a)[0].str();
            options.key_separator = (*separators->a)[1].str();
        }
        std::string out;
        try {
            to_json(v, options, 0, value_depth(), out);
        } catch (const std::runtime_error& e) {
            fail(e.what(), offset);
        }
        charge(out.size(), offset);
        return make_string(std::move(out), offset);
    }

    static Value to_number(const std::string& name, const Value& v, const Args& args) {
        const bool want_int = name == "int";
        const Value* fallback = args.get(0, "default");
        const Value def =
            fallback ? *fallback : (want_int ? Value::integer(0) : Value::floating(0));
        switch (v.kind) {
            case Kind::integer:
                return want_int ? v : Value::floating(static_cast<double>(v.i));
            case Kind::boolean:
                return want_int ? Value::integer(v.b) : Value::floating(v.b);
            case Kind::floating:
                if (!want_int) return v;
                if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return def;
                return Value::integer(static_cast<std::int64_t>(v.f));
            case Kind::string: {
                std::string_view s = trim_set(v.str(), nullptr, true, true);
                std::string digits;
                for (const char c : s) {
                    if (c != '_') digits += c;
                }
                if (!digits.empty() && digits[0] == '+') digits.erase(0, 1);
                std::int64_t i = 0;
                auto res = std::from_chars(digits.data(), digits.data() + digits.size(), i);
                if (res.ec == std::errc{} && res.ptr == digits.data() + digits.size() &&
                    !digits.empty()) {
                    return want_int ? Value::integer(i) : Value::floating(static_cast<double>(i));
                }
                double f = 0;
                auto fres = std::from_chars(digits.data(), digits.data() + digits.size(), f);
                if (fres.ec == std::errc{} && fres.ptr == digits.data() + digits.size() &&
                    !digits.empty()) {
                    if (!want_int) return Value::floating(f);
                    if (std::isfinite(f) && std::fabs(f) < 9.2e18)
                        return Value::integer(static_cast<std::int64_t>(f));
                }
                return def;
            }
            default:
                return def;
        }
    }

    Value indent(const Value& v, const Args& args, std::uint32_t offset) {
        if (!v.is_string()) fail("filter 'indent' needs a string", offset);
        const Value* width = args.get(0, "width");
        const Value* first = args.get(1, "first");
        const Value* blank = args.get(2, "blank");
        std::string pad(4, ' ');
        if (width != nullptr) {
            if (width->is_string()) {
                pad = width->str();
            } else if (width->is(Kind::integer) && width->i >= 0 && width->i <= 256) {
                pad.assign(static_cast<std::size_t>(width->i), ' ');
            } else {
                fail("indent width must be a small integer or a string", offset);
            }
        }
        // Jinja: s += "\n", splitlines(), indent lines after the first (blank ones only with
        // blank=True).
        std::vector<std::string> lines;
        const std::string s = v.str() + "\n";
        std::size_t pos = 0;
        while (pos < s.size()) {
            std::size_t end = s.find_first_of("\r\n", pos);
            if (end == std::string::npos) end = s.size();
            lines.push_back(s.substr(pos, end - pos));
            if (end < s.size() && s[end] == '\r' && end + 1 < s.size() && s[end + 1] == '\n') ++end;
            pos = end + 1;
        }
        std::string out;
        for (std::size_t k = 0; k < lines.size(); ++k) {
            if (k > 0) out += '\n';
            const bool pad_line = k > 0 && (!lines[k].empty() || (blank && truthy(*blank)));
            if (pad_line) out += pad;
            out += lines[k];
            check_size(out.size(), offset);
        }
        if (first && truthy(*first)) out = pad + out;
        return make_string(std::move(out), offset);
    }

    Value sort(const std::string& name, const Value& v, const Args& args, std::uint32_t offset) {
        const bool dictsort = name == "dictsort";
        Array items;
        if (dictsort) {
            items = *items_of(v, offset).a;
        } else {
            items = sequence_of(v, name, offset);
        }
        const Value* reverse = args.get(dictsort ? 2 : 0, "reverse");
        const Value* case_sensitive = args.get(dictsort ? 0 : 1, "case_sensitive");
        const Value* attribute = dictsort ? nullptr : args.get(2, "attribute");
        const Value* by = dictsort ? args.get(1, "by") : nullptr;
        const bool cs = case_sensitive != nullptr && truthy(*case_sensitive);
        const auto key = [&](const Value& item) {
            Value k = item;
            if (dictsort)
                k = (*item.a)[by != nullptr && by->is_string() && by->str() == "value" ? 1 : 0];
            if (attribute != nullptr) k = attribute_path(item, display(*attribute, offset), offset);
            if (!cs && k.is_string()) {
                std::string lower = k.str();
                for (auto& c : lower)
                    c = ascii_lower(c);
                return Value::string(std::move(lower));
            }
            return k;
        };
        std::vector<std::pair<Value, Value>> keyed;
        for (auto& item : items)
            keyed.emplace_back(key(item), std::move(item));
        std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
            return less(x.first, y.first, offset);
        });
        if (reverse != nullptr && truthy(*reverse)) std::reverse(keyed.begin(), keyed.end());
        Array out;
        for (auto& [k, item] : keyed)
            out.push_back(std::move(item));
        return Value::array(std::move(out));
    }

    const Program& program_;
    const ChatTemplateLimits& limits_;
    std::size_t steps_ = 0;
    int depth_ = 0;
    int nest_ = 0;  // statements and expressions being evaluated (NestGuard)
    std::vector<std::shared_ptr<Object>> namespaces_;
    std::vector<std::shared_ptr<Callable>> callables_;  // their closures are reset at the end
};

}  // namespace

std::string render(const Program& program, const Value& context, const ChatTemplateLimits& limits) {
    Interp interp(program, limits);
    return interp.run(context);
}

}  // namespace writescope::text::jinja
