// The reference side of `writescope-bench tokenize`: writes the corpus (corpus.mjs; each item a
// little-endian u32 byte length, then the bytes) to CORPUS_FILE and prints, as one JSON line,
// @huggingface/tokenizers' encode rate over it for each tokenizer: bytes of UTF-8 input per
// second, on a fresh tokenizer (first pass) and again (second pass, caches warm). Special tokens
// of the post-processor are left out on both sides (for DeepSeek, transformers' BOS, which the
// reference does not add, would make the id counts differ).
// usage: node bench_reference.mjs CORPUS_FILE [count] [names]
import fs from "node:fs";
import { make_corpus } from "./corpus.mjs";
import { TOKENIZERS, load } from "./make_golden.mjs";

const [file, countArg, namesArg] = process.argv.slice(2);
if (!file) {
    console.error("usage: node bench_reference.mjs CORPUS_FILE [count] [names]");
    process.exit(2);
}
const corpus = make_corpus(424242, Number(countArg ?? 20000), 4, 0);
const parts = [];
for (const item of corpus) {
    const len = Buffer.alloc(4);
    len.writeUInt32LE(item.length);
    parts.push(len, Buffer.from(item));
}
fs.writeFileSync(file, Buffer.concat(parts));
const decoder = new TextDecoder("utf-8", { ignoreBOM: true });
const texts = corpus.map((b) => decoder.decode(b));
const bytes = corpus.reduce((a, b) => a + b.length, 0);
const result = { items: corpus.length, bytes, tokenizers: {} };
for (const name of namesArg ? namesArg.split(",") : TOKENIZERS) {
    const tok = load(name);
    const rates = [];
    let ids = 0;
    for (let pass = 0; pass < 2; ++pass) {
        ids = 0;
        const t0 = performance.now();
        for (const t of texts) ids += tok.encode(t, { add_special_tokens: false }).ids.length;
        rates.push(bytes / ((performance.now() - t0) / 1000));
    }
    result.tokenizers[name] = { first: rates[0], second: rates[1], ids };
}
console.log(JSON.stringify(result));
