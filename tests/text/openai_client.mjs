// The official `openai` client against a running writescoped (its Unix socket), serving a model
// directory with a tokenizer and a chat template: chat and completions, streamed and not, greedy.
// What the daemon answers is checked against an independent route to the same text: the prompt
// encoded by @huggingface/tokenizers (the chat prompt rendered by @huggingface/jinja), the greedy
// ids of that prompt from the daemon's token-id route (itself checked against transformers' ids
// by test_completions.cpp), and their decode by @huggingface/tokenizers.
//
//   node openai_client.mjs --socket /run/writescope/api.sock --model-dir DIR
// Prints one line per check; exits 1 when one failed.
import fs from "node:fs";
import http from "node:http";
import path from "node:path";
import { Readable } from "node:stream";

import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";
import OpenAI from "openai";

function arg(name) {
    const i = process.argv.indexOf(name);
    if (i < 0 || i + 1 >= process.argv.length) throw new Error(`${name} is required`);
    return process.argv[i + 1];
}
const socketPath = arg("--socket");
const modelDir = arg("--model-dir");

// fetch over the Unix socket, for the client's `fetch` option: node:http with socketPath, the
// response body handed over as a web stream (so streamed completions arrive as they come).
function unixFetch(url, init = {}) {
    const u = new URL(url);
    const headers = {};
    for (const [k, v] of new Headers(init.headers ?? {})) headers[k] = v;
    return new Promise((resolve, reject) => {
        const req = http.request(
            { socketPath, path: u.pathname + u.search, method: init.method ?? "GET", headers },
            (res) => {
                const h = new Headers();
                for (let i = 0; i + 1 < res.rawHeaders.length; i += 2)
                    h.append(res.rawHeaders[i], res.rawHeaders[i + 1]);
                resolve(new Response(Readable.toWeb(res), { status: res.statusCode, headers: h }));
            });
        req.on("error", reject);
        init.signal?.addEventListener("abort", () => req.destroy(new Error("aborted")));
        if (init.body !== undefined && init.body !== null) req.write(init.body);
        req.end();
    });
}

async function post(route, body) {
    const r = await unixFetch(`http://writescope/v1${route}`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
    });
    return { status: r.status, body: await r.json() };
}

let failures = 0;
function check(what, ok, detail = "") {
    console.log(`${ok ? "ok  " : "FAIL"} ${what}${ok || !detail ? "" : `: ${detail}`}`);
    if (!ok) failures += 1;
}
// JSON with object keys sorted: equal values print the same.
function canonical(v) {
    return JSON.stringify(v, (_, x) =>
        x && typeof x === "object" && !Array.isArray(x)
            ? Object.fromEntries(Object.keys(x).sort().map((k) => [k, x[k]]))
            : x);
}
function checkEqual(what, got, want) {
    const g = canonical(got), w = canonical(want);
    check(what, g === w, `got ${g}, want ${w}`);
}

const tokJson = JSON.parse(fs.readFileSync(path.join(modelDir, "tokenizer.json"), "utf8"));
const tokConfig = JSON.parse(fs.readFileSync(path.join(modelDir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokJson, tokConfig);
const template = new Template(tokConfig.chat_template);
const decode = (ids) => tokenizer.decode(ids, { skip_special_tokens: true });
const render = (messages, kwargs = {}) =>
    template.render({
        messages,
        add_generation_prompt: true,
        bos_token: tokConfig.bos_token,
        eos_token: tokConfig.eos_token,
        ...kwargs,
    });

// The daemon's greedy ids for a prompt of ids (the token-id route).
async function greedy(ids, maxTokens, extra = {}) {
    const r = await post("/completions", { prompt: ids, max_tokens: maxTokens, temperature: 0, ...extra });
    if (r.status !== 200) throw new Error(`token-id completion: ${JSON.stringify(r.body)}`);
    const c = r.body.choices[0];
    return { ids: c.token_ids, finish: c.finish_reason };
}

// A stop string from the middle of a text (whole code points), and where it first occurs.
function stopFrom(text) {
    const cps = Array.from(text);
    const start = Math.floor(cps.length / 2);
    const stop = cps.slice(start, start + 3).join("");
    return { stop, cut: text.slice(0, text.indexOf(stop)) };
}

const client = new OpenAI({ apiKey: "unused", baseURL: "http://writescope/v1", fetch: unixFetch, maxRetries: 0 });

// --- the model and the tokenizer
const models = await client.models.list();
const model = models.data[0];
check("models.list serves one model with a tokenizer and a chat template",
      models.data.length === 1 && model.tokenizer === true && model.chat_template === true,
      JSON.stringify(models.data));
checkEqual("models.retrieve gives the listed model", await client.models.retrieve(model.id), model);

const texts = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you?\n\n  ok",
               "héllo 世界 🙂 <|im_start|>user\nhi<|im_end|>", "", "  leading spaces and 1234567"];
for (const t of texts) {
    for (const special of [true, false]) {
        const want = tokenizer.encode(t, { add_special_tokens: special }).ids;
        const got = await post("/tokenize", { prompt: t, add_special_tokens: special });
        checkEqual(`/v1/tokenize ${JSON.stringify(t).slice(0, 30)} add_special_tokens=${special}`,
                   got.body.tokens, want);
        if (special) {
            const back = await post("/detokenize", { tokens: want });
            checkEqual("/v1/detokenize gives the text back", back.body.prompt,
                       tokenizer.decode(want, { skip_special_tokens: false }));
        }
    }
}

// --- completions
const promptText = "The quick brown fox";
const promptIds = tokenizer.encode(promptText).ids;
check("the text prompt's ids start with the post-processor's BOS", promptIds[0] === tokJson.post_processor.special_tokens["<|endoftext|>"].ids[0]);
const ref = await greedy(promptIds, 24, { ignore_eos: true });
const refText = decode(ref.ids);
{
    const r = await client.completions.create({ model: model.id, prompt: promptText, max_tokens: 24, temperature: 0, ignore_eos: true });
    checkEqual("completions: text = decode(greedy ids of the encoded prompt)", r.choices[0].text, refText);
    checkEqual("completions: token_ids", r.choices[0].token_ids, ref.ids);
    checkEqual("completions: usage", r.usage, { prompt_tokens: promptIds.length, completion_tokens: 24, total_tokens: promptIds.length + 24 });
    checkEqual("completions: finish_reason length", r.choices[0].finish_reason, "length");
}
{
    const stream = await client.completions.create({ model: model.id, prompt: promptText, max_tokens: 24, temperature: 0, ignore_eos: true, stream: true, stream_options: { include_usage: true } });
    let text = "", finish = null, usage = null;
    for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices) {
            text += c.text;
            if (c.finish_reason) finish = c.finish_reason;
        }
    }
    checkEqual("completions streamed: the text", text, refText);
    checkEqual("completions streamed: finish_reason", finish, "length");
    checkEqual("completions streamed: usage", usage?.completion_tokens, 24);
}
{
    // The reference prompt of tests/data/models/qwen3-moe-tiny (ids), whose greedy continuation
    // transformers computed: the text is its decode, up to the eos (<|im_end|>) if it comes.
    const reference = JSON.parse(fs.readFileSync(path.join(modelDir, "../qwen3-moe-tiny/reference.json"), "utf8"));
    const p = reference.prompts[0];
    const eos = JSON.parse(fs.readFileSync(path.join(modelDir, "config.json"), "utf8")).eos_token_id;
    const cut = p.greedy.indexOf(eos);
    const want = cut < 0 ? p.greedy : p.greedy.slice(0, cut + 1);
    const r = await client.completions.create({ model: model.id, prompt: p.ids, max_tokens: p.greedy.length, temperature: 0 });
    checkEqual("completions of the reference ids: transformers' greedy tokens", r.choices[0].token_ids, want);
    checkEqual("completions of the reference ids: their decode", r.choices[0].text, decode(want));
}
{
    const { stop, cut } = stopFrom(refText);
    const r = await client.completions.create({ model: model.id, prompt: promptText, max_tokens: 24, temperature: 0, ignore_eos: true, stop: [stop, "\u{1F600}never"] });
    checkEqual(`completions stop ${JSON.stringify(stop)}: the text ends before it`, r.choices[0].text, cut);
    checkEqual("completions stop: finish_reason stop", r.choices[0].finish_reason, "stop");
    check("completions stop: fewer tokens than max_tokens", r.usage.completion_tokens < 24 && r.usage.completion_tokens === r.choices[0].token_ids.length, JSON.stringify(r.usage));
    const stream = await client.completions.create({ model: model.id, prompt: promptText, max_tokens: 24, temperature: 0, ignore_eos: true, stop, stream: true });
    let text = "", finish = null;
    for await (const chunk of stream)
        for (const c of chunk.choices) {
            text += c.text;
            if (c.finish_reason) finish = c.finish_reason;
        }
    checkEqual("completions streamed stop: the text ends before it", text, cut);
    checkEqual("completions streamed stop: finish_reason", finish, "stop");
}
{
    const r = await client.completions.create({ model: model.id, prompt: promptText, max_tokens: 4, temperature: 0, ignore_eos: true, echo: true });
    checkEqual("completions echo: the prompt, then the text", r.choices[0].text, promptText + decode(ref.ids.slice(0, 4)));
}
{
    // Several prompts in one request, as OpenAI takes them: choice index = prompt × n + j, each
    // choice its own prompt's greedy continuation, the usage over all prompts; streamed, every
    // index's text; with echo, each choice begins with its own prompt.
    const second = "Hello there, how are you?";
    const secondIds = tokenizer.encode(second).ids;
    const ref2 = await greedy(secondIds, 6, { ignore_eos: true });
    const wants = [decode(ref.ids.slice(0, 6)), decode(ref2.ids)];
    const r = await client.completions.create({ model: model.id, prompt: [promptText, second], n: 2, max_tokens: 6, temperature: 0, ignore_eos: true });
    checkEqual("completions of two prompts, n 2: four choices in order", r.choices.map((c) => c.index), [0, 1, 2, 3]);
    checkEqual("completions of two prompts: each choice its prompt's greedy text", r.choices.map((c) => c.text), [wants[0], wants[0], wants[1], wants[1]]);
    checkEqual("completions of two prompts: usage over both prompts", r.usage, { prompt_tokens: promptIds.length + secondIds.length, completion_tokens: 24, total_tokens: promptIds.length + secondIds.length + 24 });
    const stream = await client.completions.create({ model: model.id, prompt: [promptText, second], max_tokens: 6, temperature: 0, ignore_eos: true, stream: true });
    const streamed = ["", ""];
    for await (const chunk of stream)
        for (const c of chunk.choices) streamed[c.index] += c.text;
    checkEqual("completions of two prompts streamed: each index's text", streamed, wants);
    const echoed = await client.completions.create({ model: model.id, prompt: [second, promptText], max_tokens: 6, temperature: 0, ignore_eos: true, echo: true });
    checkEqual("completions of two prompts with echo: each choice begins with its prompt", echoed.choices.map((c) => c.text), [second + wants[1], promptText + wants[0]]);
}

// --- chat completions
const messages = [
    { role: "system", content: "You are a test." },
    { role: "user", content: [{ type: "text", text: "Hello there," }, { type: "text", text: "how are you?" }] },
];
const flat = [messages[0], { role: "user", content: "Hello there,\nhow are you?" }];
const chatIds = tokenizer.encode(render(flat), { add_special_tokens: false }).ids;
check("the rendered chat prompt has one BOS (the template's), none added", chatIds[0] === 312 && chatIds[1] !== 312, JSON.stringify(chatIds.slice(0, 3)));
const chatRef = await greedy(chatIds, 20);
const chatText = decode(chatRef.ids);
{
    const r = await client.chat.completions.create({ model: model.id, messages, max_tokens: 20, temperature: 0 });
    checkEqual("chat: the content = decode(greedy ids of the rendered prompt)", r.choices[0].message.content, chatText);
    checkEqual("chat: role", r.choices[0].message.role, "assistant");
    checkEqual("chat: usage", r.usage, { prompt_tokens: chatIds.length, completion_tokens: chatRef.ids.length, total_tokens: chatIds.length + chatRef.ids.length });
    checkEqual("chat: finish_reason", r.choices[0].finish_reason, chatRef.finish);
    checkEqual("chat: object", r.object, "chat.completion");
}
{
    const stream = await client.chat.completions.create({ model: model.id, messages, max_completion_tokens: 20, temperature: 0, stream: true, stream_options: { include_usage: true } });
    let text = "", finish = null, usage = null, first = null, afterUsage = false;
    for await (const chunk of stream) {
        if (first === null) first = chunk;
        if (chunk.usage) {
            usage = chunk.usage;
            check("chat streamed: the usage chunk has no choices", chunk.choices.length === 0);
            continue;
        }
        if (usage) afterUsage = true;
        for (const c of chunk.choices) {
            text += c.delta.content ?? "";
            if (c.finish_reason) finish = c.finish_reason;
        }
    }
    checkEqual("chat streamed: the first chunk's delta", first.choices[0].delta, { role: "assistant", content: "" });
    checkEqual("chat streamed: chunk object", first.object, "chat.completion.chunk");
    checkEqual("chat streamed: the content", text, chatText);
    checkEqual("chat streamed: finish_reason", finish, chatRef.finish);
    checkEqual("chat streamed: usage last", [usage?.completion_tokens, usage?.prompt_tokens, afterUsage], [chatRef.ids.length, chatIds.length, false]);
}
{
    const kwIds = tokenizer.encode(render(flat, { enable_thinking: false }), { add_special_tokens: false }).ids;
    const kwRef = await greedy(kwIds, 12);
    const r = await client.chat.completions.create({ model: model.id, messages, max_tokens: 12, temperature: 0, chat_template_kwargs: { enable_thinking: false } });
    checkEqual("chat chat_template_kwargs enable_thinking=false: the prompt", r.usage.prompt_tokens, kwIds.length);
    checkEqual("chat chat_template_kwargs: the content", r.choices[0].message.content, decode(kwRef.ids));
}
{
    const longRef = await greedy(chatIds, 30, { ignore_eos: true });
    const longText = decode(longRef.ids);
    const { stop, cut } = stopFrom(longText);
    const r = await client.chat.completions.create({ model: model.id, messages, max_tokens: 30, temperature: 0, ignore_eos: true, stop });
    checkEqual(`chat stop ${JSON.stringify(stop)}: the content ends before it`, r.choices[0].message.content, cut);
    checkEqual("chat stop: finish_reason", r.choices[0].finish_reason, "stop");
    const stream = await client.chat.completions.create({ model: model.id, messages, max_tokens: 30, temperature: 0, ignore_eos: true, stop, stream: true });
    let text = "", finish = null;
    for await (const chunk of stream)
        for (const c of chunk.choices) {
            text += c.delta.content ?? "";
            if (c.finish_reason) finish = c.finish_reason;
        }
    checkEqual("chat streamed stop: the content", text, cut);
    checkEqual("chat streamed stop: finish_reason", finish, "stop");
}
{
    const r = await client.chat.completions.create({ model: model.id, messages, max_tokens: 8, temperature: 0, n: 3, logprobs: true, top_logprobs: 2 });
    checkEqual("chat n=3: three choices", r.choices.map((c) => c.index), [0, 1, 2]);
    const want = decode((await greedy(chatIds, 8)).ids);
    check("chat n=3 greedy: each choice is the greedy text", r.choices.every((c) => c.message.content === want), JSON.stringify(r.choices.map((c) => c.message.content)));
    check("chat logprobs: one entry per token, two top_logprobs each",
          r.choices.every((c) => c.logprobs.content.length === r.usage.completion_tokens / 3 && c.logprobs.content.every((e) => e.top_logprobs.length === 2 && typeof e.token === "string")),
          JSON.stringify(r.choices[0].logprobs));
}
{
    // The client's sampling fields: logit_bias (an object of token ids as the SDK types it) and
    // the penalties, against the token-id route given the same fields.
    const banned = (await greedy(chatIds, 1)).ids[0];
    const fields = { logit_bias: { [String(banned)]: -100 }, presence_penalty: 1.5, frequency_penalty: 0.5 };
    const r = await client.chat.completions.create({ model: model.id, messages, max_tokens: 8, temperature: 0, ignore_eos: true, ...fields });
    const want = await greedy(chatIds, 8, { ignore_eos: true, ...fields });
    checkEqual("chat logit_bias and penalties: the token-id route's greedy text with the same fields", r.choices[0].message.content, decode(want.ids));
    check("chat logit_bias -100: the greedy first token is banned", want.ids[0] !== banned, JSON.stringify(want.ids));
    const s = await client.chat.completions.create({ model: model.id, messages, max_tokens: 2, temperature: 0, store: false, metadata: { run: "ci" }, user: "u" });
    check("chat store: false with metadata is accepted", s.choices.length === 1);
}
for (const [what, body, needle] of [
    ["a bad role", { messages: [{ role: "wizard", content: "hi" }] }, "role"],
    ["n too large", { messages, n: 129 }, "\"n\""],
    ["an unknown field", { messages, frobnicate: 1 }, "frobnicate"],
    ["an image part", { messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: "x" } }] }] }, "image_url"],
    ["a prompt longer than the context", { messages: [{ role: "user", content: "word ".repeat(600) }] }, "context"],
    ["store: true", { messages, store: true }, "store"],
    ["reasoning_effort", { messages, reasoning_effort: "low" }, "reasoning_effort"],
    ["a logit_bias past the vocabulary", { messages, logit_bias: { "1000000": 5 } }, "logit_bias"],
]) {
    try {
        await client.chat.completions.create({ model: model.id, max_tokens: 4, ...body });
        check(`chat refuses ${what}`, false, "it was accepted");
    } catch (e) {
        check(`chat refuses ${what}: 400 naming it`, e.status === 400 && String(e.message).includes(needle), `${e.status} ${e.message}`);
    }
}

console.log(failures ? `${failures} check(s) failed` : "every check passed");
process.exit(failures ? 1 : 0);
