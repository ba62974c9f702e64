// The parser: Jinja's grammar and operator precedence (jinja2/parser.py's order: conditional
// expression, or, and, not, comparisons, + -, ~, * / // %, **, unary sign, postfix, filters
// and tests), for the statements and names that chat templates use. Anything else is refused
// here, at load, with its line and column.
#include <algorithm>
#include <array>
#include <charconv>
#include <unordered_set>

#include "jinja_ast.hpp"

namespace writescope::text::jinja {

namespace {

constexpr std::array kFilters = {
    "abs",    "capitalize", "count",      "d",       "default", "dictsort", "first",  "float",
    "indent", "int",        "items",      "join",    "last",    "length",   "list",   "lower",
    "map",    "reject",     "rejectattr", "replace", "reverse", "safe",     "select", "selectattr",
    "sort",   "string",     "title",      "tojson",  "trim",    "unique",   "upper"};
constexpr std::array kTests = {
    "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
    "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
    "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
    "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper"};
constexpr std::array kMethods = {
    // str
    "capitalize", "count", "endswith", "find", "join", "lower", "lstrip", "replace", "rstrip",
    "split", "startswith", "strip", "title", "upper",
    // dict
    "get", "items", "keys", "values"};
constexpr std::array kGlobals = {"namespace", "raise_exception", "range", "strftime_now", "dict"};

template <std::size_t N>
bool contains(const std::array<const char*, N>& names, std::string_view name) {
    return std::any_of(names.begin(), names.end(), [&](const char* n) { return name == n; });
}

constexpr int kMaxNesting = 200;

class Parser {
  public:
    Parser(const std::vector<Token>& tokens) : t_(tokens) {}

    void run(Program& program) {
        std::string end;
        program.body = parse_body({}, end);
        for (const auto& [name, offset] : called_names_) {
            if (!is_supported_global(name) && name != "caller" && !macros_.contains(name)) {
                fail("unsupported function '" + name + "'", offset);
            }
        }
    }

  private:
    using Type = Token::Type;

    [[noreturn]] static void fail(const std::string& message, std::uint32_t offset) {
        throw SourceError(message, offset);
    }
    [[noreturn]] void fail_here(const std::string& message) { fail(message, peek().offset); }

    const Token& peek(std::size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
    const Token& next() {
        const Token& tok = peek();
        if (p_ < t_.size() - 1) ++p_;
        return tok;
    }
    bool is_op(std::string_view v, std::size_t k = 0) const {
        return peek(k).type == Type::op && peek(k).value == v;
    }
    bool is_name(std::string_view v, std::size_t k = 0) const {
        return peek(k).type == Type::name && peek(k).value == v;
    }
    void expect_op(std::string_view v) {
        if (!is_op(v)) fail_here("expected '" + std::string(v) + "'" + found());
        next();
    }
    std::string expect_name() {
        if (peek().type != Type::name) fail_here("expected a name" + found());
        return next().value;
    }
    void expect_close_stmt() {
        if (peek().type != Type::close_stmt) fail_here("expected '%}'" + found());
        next();
    }
    std::string found() const {
        const Token& tok = peek();
        switch (tok.type) {
            case Type::end:
                return ", found the end of the template";
            case Type::close_stmt:
                return ", found '%}'";
            case Type::close_expr:
                return ", found '}}'";
            case Type::text:
                return ", found text";
            default:
                return ", found '" + tok.value + "'";
        }
    }

    struct DepthGuard {
        DepthGuard(Parser& parser, std::uint32_t offset) : owner(parser) {
            if (++owner.depth_ > kMaxNesting) fail("template nested too deeply", offset);
        }
        ~DepthGuard() { --owner.depth_; }
        Parser& owner;
    };

    ExprPtr node(Expr::Kind kind, std::uint32_t offset) {
        auto e = std::make_unique<Expr>();
        e->kind = kind;
        e->offset = offset;
        return e;
    }
    StmtPtr stmt(Stmt::Kind kind, std::uint32_t offset) {
        auto s = std::make_unique<Stmt>();
        s->kind = kind;
        s->offset = offset;
        return s;
    }

    // Statements until `{% name` with a name in `ends` (left unconsumed after the `{%`
    // and the name, which goes to `end`), or the end of the template when `ends` is empty.
    Body parse_body(std::initializer_list<const char*> ends, std::string& end) {
        Body body;
        while (true) {
            const Token& tok = peek();
            if (tok.type == Type::end) {
                if (ends.size() == 0) return body;
                std::string expected;
                for (const char* e : ends)
                    expected += std::string(expected.empty() ? "" : " or ") + "'" + e + "'";
                fail("missing " + expected + " before the end of the template", tok.offset);
            }
            if (tok.type == Type::text) {
                auto s = stmt(Stmt::Kind::text, tok.offset);
                s->text = next().value;
                body.push_back(std::move(s));
                continue;
            }
            if (tok.type == Type::open_expr) {
                next();
                auto s = stmt(Stmt::Kind::output, tok.offset);
                s->expr = parse_tuple();
                if (peek().type != Type::close_expr) fail_here("expected '}}'" + found());
                next();
                body.push_back(std::move(s));
                continue;
            }
            if (tok.type != Type::open_stmt) fail_here("unexpected token" + found());
            if (peek(1).type == Type::name) {
                const std::string& name = peek(1).value;
                if (std::any_of(ends.begin(), ends.end(),
                                [&](const char* e) { return name == e; })) {
                    next();
                    end = next().value;
                    return body;
                }
            }
            body.push_back(parse_statement());
        }
    }

    StmtPtr parse_statement() {
        const std::uint32_t offset = next().offset;  // {%
        DepthGuard guard(*this, offset);
        if (peek().type != Type::name) fail_here("expected a statement name" + found());
        const std::string name = next().value;
        std::string end;
        if (name == "if") return parse_if(offset);
        if (name == "for") {
            auto s = stmt(Stmt::Kind::for_, offset);
            s->target = parse_assign_target(false);
            if (!is_name("in")) fail_here("expected 'in'" + found());
            next();
            s->expr = parse_tuple(false);
            if (is_name("if")) {
                next();
                s->cond = parse_expr();
            }
            if (is_name("recursive")) fail_here("unsupported: recursive for loops");
            expect_close_stmt();
            ++loops_;
            s->body = parse_body({"else", "endfor"}, end);
            --loops_;
            if (end == "else") {
                expect_close_stmt();
                s->else_body = parse_body({"endfor"}, end);
            }
            expect_close_stmt();
            return s;
        }
        if (name == "set") {
            auto target = parse_assign_target(true);
            if (is_op("=")) {
                next();
                auto s = stmt(Stmt::Kind::set, offset);
                s->target = std::move(target);
                s->expr = parse_tuple();
                expect_close_stmt();
                return s;
            }
            if (target->kind != Expr::Kind::name) fail_here("expected '='" + found());
            auto s = stmt(Stmt::Kind::set_block, offset);
            s->target = std::move(target);
            expect_close_stmt();
            s->body = parse_body({"endset"}, end);
            expect_close_stmt();
            return s;
        }
        if (name == "macro") {
            auto s = stmt(Stmt::Kind::macro, offset);
            s->name = expect_name();
            macros_.insert(s->name);
            s->params = parse_params();
            expect_close_stmt();
            s->body = parse_body({"endmacro"}, end);
            if (peek().type == Type::name) next();  // {% endmacro name %}
            expect_close_stmt();
            return s;
        }
        if (name == "call") {
            auto s = stmt(Stmt::Kind::call_block, offset);
            if (is_op("(")) s->params = parse_params();
            s->expr = parse_unary();
            if (s->expr->kind != Expr::Kind::call) fail("expected a call after 'call'", offset);
            expect_close_stmt();
            s->body = parse_body({"endcall"}, end);
            expect_close_stmt();
            return s;
        }
        if (name == "filter") {
            auto s = stmt(Stmt::Kind::filter_block, offset);
            s->expr = parse_filter(nullptr);
            expect_close_stmt();
            s->body = parse_body({"endfilter"}, end);
            expect_close_stmt();
            return s;
        }
        if (name == "break" || name == "continue") {
            if (loops_ == 0) fail("'" + name + "' outside a loop", offset);
            expect_close_stmt();
            return stmt(name == "break" ? Stmt::Kind::break_ : Stmt::Kind::continue_, offset);
        }
        if (name == "generation") {
            // transformers' marker of assistant tokens: renders its body unchanged.
            expect_close_stmt();
            auto s = stmt(Stmt::Kind::if_, offset);
            s->expr = node(Expr::Kind::literal, offset);
            s->expr->value = Value::boolean(true);
            s->body = parse_body({"endgeneration"}, end);
            expect_close_stmt();
            return s;
        }
        fail("unsupported statement '" + name + "'", offset);
    }

    StmtPtr parse_if(std::uint32_t offset) {
        auto s = stmt(Stmt::Kind::if_, offset);
        s->expr = parse_tuple();
        expect_close_stmt();
        std::string end;
        s->body = parse_body({"elif", "else", "endif"}, end);
        if (end == "elif") {
            s->else_body.push_back(parse_if(peek().offset));
            return s;  // the nested if consumed the endif
        }
        if (end == "else") {
            expect_close_stmt();
            s->else_body = parse_body({"endif"}, end);
        }
        expect_close_stmt();
        return s;
    }

    std::vector<Param> parse_params() {
        std::vector<Param> params;
        expect_op("(");
        while (!is_op(")")) {
            Param param;
            param.name = expect_name();
            if (is_op("=")) {
                next();
                param.default_value = parse_expr();
            }
            params.push_back(std::move(param));
            if (!is_op(",")) break;
            next();
        }
        expect_op(")");
        return params;
    }

    // A name, `ns.attr` (set only), or names separated by commas.
    ExprPtr parse_assign_target(bool allow_attr) {
        const std::uint32_t offset = peek().offset;
        auto first = node(Expr::Kind::name, offset);
        first->name = expect_name();
        if (allow_attr && is_op(".")) {
            next();
            auto attr = node(Expr::Kind::attr, offset);
            attr->name = expect_name();
            attr->args.push_back(std::move(first));
            return attr;
        }
        if (!is_op(",")) return first;
        auto tuple = node(Expr::Kind::tuple, offset);
        tuple->args.push_back(std::move(first));
        while (is_op(",")) {
            next();
            if (peek().type != Type::name) break;
            auto item = node(Expr::Kind::name, peek().offset);
            item->name = next().value;
            tuple->args.push_back(std::move(item));
        }
        return tuple;
    }

    // An expression, or a tuple of them without parentheses.
    ExprPtr parse_tuple(bool allow_cond = true) {
        const std::uint32_t offset = peek().offset;
        auto first = allow_cond ? parse_expr() : parse_or();
        if (!is_op(",")) return first;
        auto tuple = node(Expr::Kind::tuple, offset);
        tuple->args.push_back(std::move(first));
        while (is_op(",")) {
            next();
            if (peek().type == Type::close_expr || peek().type == Type::close_stmt || is_op(")") ||
                is_name("if") || is_op("=")) {
                break;
            }
            tuple->args.push_back(allow_cond ? parse_expr() : parse_or());
        }
        return tuple;
    }

    ExprPtr parse_expr() {
        DepthGuard guard(*this, peek().offset);
        auto e = parse_or();
        while (is_name("if")) {
            const std::uint32_t offset = next().offset;
            auto c = node(Expr::Kind::cond, offset);
            c->args.push_back(parse_or());
            c->args.push_back(std::move(e));
            if (is_name("else")) {
                next();
                c->args.push_back(parse_expr());
            } else {
                c->args.push_back(nullptr);
            }
            e = std::move(c);
        }
        return e;
    }

    ExprPtr binary(Expr::Kind kind, std::uint32_t offset, ExprPtr left, ExprPtr right,
                   std::string op = {}) {
        auto e = node(kind, offset);
        e->name = std::move(op);
        e->args.push_back(std::move(left));
        e->args.push_back(std::move(right));
        return e;
    }

    ExprPtr parse_or() {
        auto e = parse_and();
        while (is_name("or")) {
            const std::uint32_t offset = next().offset;
            e = binary(Expr::Kind::or_, offset, std::move(e), parse_and());
        }
        return e;
    }

    ExprPtr parse_and() {
        auto e = parse_not();
        while (is_name("and")) {
            const std::uint32_t offset = next().offset;
            e = binary(Expr::Kind::and_, offset, std::move(e), parse_not());
        }
        return e;
    }

    ExprPtr parse_not() {
        if (is_name("not")) {
            const std::uint32_t offset = next().offset;
            DepthGuard guard(*this, offset);
            auto e = node(Expr::Kind::not_, offset);
            e->args.push_back(parse_not());
            return e;
        }
        return parse_compare();
    }

    ExprPtr parse_compare() {
        const std::uint32_t offset = peek().offset;
        auto first = parse_math1();
        ExprPtr cmp;
        while (true) {
            std::string op;
            if (peek().type == Type::op && (is_op("==") || is_op("!=") || is_op("<") ||
                                            is_op(">") || is_op("<=") || is_op(">="))) {
                op = next().value;
            } else if (is_name("in")) {
                next();
                op = "in";
            } else if (is_name("not") && is_name("in", 1)) {
                next();
                next();
                op = "not in";
            } else {
                break;
            }
            if (!cmp) {
                cmp = node(Expr::Kind::compare, offset);
                cmp->args.push_back(std::move(first));
            }
            cmp->ops.push_back(op);
            cmp->args.push_back(parse_math1());
        }
        return cmp ? std::move(cmp) : std::move(first);
    }

    ExprPtr parse_math1() {
        auto e = parse_concat();
        while (is_op("+") || is_op("-")) {
            const Token& op = next();
            e = binary(Expr::Kind::binary, op.offset, std::move(e), parse_concat(), op.value);
        }
        return e;
    }

    ExprPtr parse_concat() {
        auto e = parse_math2();
        while (is_op("~")) {
            const Token& op = next();
            e = binary(Expr::Kind::binary, op.offset, std::move(e), parse_math2(), "~");
        }
        return e;
    }

    ExprPtr parse_math2() {
        auto e = parse_pow();
        while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
            const Token& op = next();
            e = binary(Expr::Kind::binary, op.offset, std::move(e), parse_pow(), op.value);
        }
        return e;
    }

    ExprPtr parse_pow() {
        auto e = parse_unary();
        while (is_op("**")) {
            const Token& op = next();
            e = binary(Expr::Kind::binary, op.offset, std::move(e), parse_unary(), "**");
        }
        return e;
    }

    ExprPtr parse_unary(bool with_filter = true) {
        DepthGuard guard(*this, peek().offset);
        ExprPtr e;
        if (is_op("-") || is_op("+")) {
            const Token& op = next();
            e = node(op.value == "-" ? Expr::Kind::neg : Expr::Kind::pos, op.offset);
            e->args.push_back(parse_unary(false));
        } else {
            e = parse_postfix(parse_primary());
        }
        if (!with_filter) return e;
        while (true) {
            if (is_op("|")) {
                next();
                e = parse_filter(std::move(e));
            } else if (is_name("is")) {
                e = parse_test(std::move(e));
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    ExprPtr parse_primary() {
        const Token& tok = peek();
        const std::uint32_t offset = tok.offset;
        DepthGuard guard(*this, offset);
        switch (tok.type) {
            case Type::name: {
                next();
                auto e = node(Expr::Kind::literal, offset);
                if (tok.value == "true" || tok.value == "True") {
                    e->value = Value::boolean(true);
                } else if (tok.value == "false" || tok.value == "False") {
                    e->value = Value::boolean(false);
                } else if (tok.value == "none" || tok.value == "None") {
                    e->value = Value::none();
                } else {
                    e->kind = Expr::Kind::name;
                    e->name = tok.value;
                }
                return e;
            }
            case Type::string: {
                std::string value = next().value;
                while (peek().type == Type::string)
                    value += next().value;
                auto e = node(Expr::Kind::literal, offset);
                e->value = Value::string(std::move(value));
                return e;
            }
            case Type::integer: {
                next();
                std::int64_t v = 0;
                const auto res =
                    std::from_chars(tok.value.data(), tok.value.data() + tok.value.size(), v);
                if (res.ec != std::errc{}) fail("integer literal out of range", offset);
                auto e = node(Expr::Kind::literal, offset);
                e->value = Value::integer(v);
                return e;
            }
            case Type::floating: {
                next();
                double v = 0;
                const auto res =
                    std::from_chars(tok.value.data(), tok.value.data() + tok.value.size(), v);
                if (res.ec != std::errc{}) fail("bad float literal", offset);
                auto e = node(Expr::Kind::literal, offset);
                e->value = Value::floating(v);
                return e;
            }
            case Type::op: {
                if (tok.value == "(") {
                    next();
                    if (is_op(")")) {
                        next();
                        return node(Expr::Kind::tuple, offset);
                    }
                    auto e = parse_tuple();
                    expect_op(")");
                    return e;
                }
                if (tok.value == "[") {
                    next();
                    auto e = node(Expr::Kind::list, offset);
                    while (!is_op("]")) {
                        e->args.push_back(parse_expr());
                        if (!is_op(",")) break;
                        next();
                    }
                    expect_op("]");
                    return e;
                }
                if (tok.value == "{") {
                    next();
                    auto e = node(Expr::Kind::dict, offset);
                    while (!is_op("}")) {
                        e->args.push_back(parse_expr());
                        expect_op(":");
                        e->args.push_back(parse_expr());
                        if (!is_op(",")) break;
                        next();
                    }
                    expect_op("}");
                    return e;
                }
                break;
            }
            default:
                break;
        }
        fail_here("expected an expression" + found());
    }

    ExprPtr parse_postfix(ExprPtr e) {
        while (true) {
            if (is_op(".")) {
                const std::uint32_t offset = next().offset;
                if (peek().type == Type::integer) {
                    auto item = node(Expr::Kind::item, offset);
                    auto index = node(Expr::Kind::literal, peek().offset);
                    std::int64_t v = 0;
                    const std::string& digits = next().value;
                    std::from_chars(digits.data(), digits.data() + digits.size(), v);
                    index->value = Value::integer(v);
                    item->args.push_back(std::move(e));
                    item->args.push_back(std::move(index));
                    e = std::move(item);
                    continue;
                }
                auto attr = node(Expr::Kind::attr, offset);
                attr->name = expect_name();
                attr->args.push_back(std::move(e));
                e = std::move(attr);
            } else if (is_op("[")) {
                const std::uint32_t offset = next().offset;
                e = parse_subscript(std::move(e), offset);
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    ExprPtr parse_subscript(ExprPtr object, std::uint32_t offset) {
        ExprPtr start;
        if (!is_op(":")) start = parse_expr();
        if (!is_op(":")) {
            expect_op("]");
            auto item = node(Expr::Kind::item, offset);
            item->args.push_back(std::move(object));
            item->args.push_back(std::move(start));
            return item;
        }
        next();
        ExprPtr stop, step;
        if (!is_op("]") && !is_op(":")) stop = parse_expr();
        if (is_op(":")) {
            next();
            if (!is_op("]")) step = parse_expr();
        }
        expect_op("]");
        auto slice = node(Expr::Kind::slice, offset);
        slice->args.push_back(std::move(object));
        slice->args.push_back(std::move(start));
        slice->args.push_back(std::move(stop));
        slice->args.push_back(std::move(step));
        return slice;
    }

    // `(args)` into e->args (after any operand already there) and e->kwargs.
    void parse_args(Expr& e) {
        expect_op("(");
        while (!is_op(")")) {
            if (is_op("*") || is_op("**")) fail_here("unsupported: * and ** in calls");
            if (peek().type == Type::name && is_op("=", 1)) {
                std::string key = next().value;
                next();
                e.kwargs.emplace_back(std::move(key), parse_expr());
            } else {
                if (!e.kwargs.empty()) fail_here("positional argument after a keyword argument");
                e.args.push_back(parse_expr());
            }
            if (!is_op(",")) break;
            next();
        }
        expect_op(")");
    }

    ExprPtr parse_call(ExprPtr callee) {
        auto call = node(Expr::Kind::call, peek().offset);
        if (callee->kind == Expr::Kind::attr) {
            if (!is_supported_method(callee->name)) {
                fail("unsupported method '" + callee->name + "'", callee->offset);
            }
        } else if (callee->kind == Expr::Kind::name) {
            called_names_.emplace_back(callee->name, callee->offset);
        } else {
            fail("unsupported call of an expression", callee->offset);
        }
        call->args.push_back(std::move(callee));
        parse_args(*call);
        return call;
    }

    // `name(args)` after a `|`; operand may be null (a filter block).
    ExprPtr parse_filter(ExprPtr operand) {
        const std::uint32_t offset = peek().offset;
        auto f = node(Expr::Kind::filter, offset);
        f->name = expect_name();
        if (!is_supported_filter(f->name)) fail("unsupported filter '" + f->name + "'", offset);
        f->args.push_back(std::move(operand));
        if (is_op("(")) parse_args(*f);
        return f;
    }

    ExprPtr parse_test(ExprPtr operand) {
        next();  // is
        auto t = node(Expr::Kind::test, peek().offset);
        if (is_name("not")) {
            next();
            t->negate = true;
        }
        const std::uint32_t offset = peek().offset;
        t->name = expect_name();
        if (!is_supported_test(t->name)) fail("unsupported test '" + t->name + "'", offset);
        t->args.push_back(std::move(operand));
        if (is_op("(")) {
            parse_args(*t);
        } else {
            const Token& tok = peek();
            const bool starts_arg =
                ((tok.type == Type::name && tok.value != "else" && tok.value != "or" &&
                  tok.value != "and" && tok.value != "is") ||
                 tok.type == Type::string || tok.type == Type::integer ||
                 tok.type == Type::floating || is_op("[") || is_op("{"));
            if (starts_arg) t->args.push_back(parse_postfix(parse_primary()));
        }
        return t;
    }

    const std::vector<Token>& t_;
    std::size_t p_ = 0;
    int depth_ = 0;
    int loops_ = 0;
    std::unordered_set<std::string> macros_;
    std::vector<std::pair<std::string, std::uint32_t>> called_names_;
};

}  // namespace

bool is_supported_filter(std::string_view name) {
    return contains(kFilters, name);
}
bool is_supported_test(std::string_view name) {
    return contains(kTests, name);
}
bool is_supported_method(std::string_view name) {
    return contains(kMethods, name);
}
bool is_supported_global(std::string_view name) {
    return contains(kGlobals, name);
}

void parse(const std::vector<Token>& tokens, Program& program) {
    Parser(tokens).run(program);
}

}  // namespace writescope::text::jinja
