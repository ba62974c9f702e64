// Writes 1200 valid-UTF-8 strings of the tokenizer corpus (seed 20261201) as a JSON list, for
// checking against transformers on the GPU machine (transformers_ids.py; docs/text.md).
import { make_corpus } from './corpus.mjs';
import fs from 'fs';
const items = make_corpus(20261201, 1500, 0, 0);
const dec = new TextDecoder('utf-8', { fatal: true });
const out = [];
for (const b of items) { try { out.push(dec.decode(b)); } catch (e) {} if (out.length >= 1200) break; }
fs.writeFileSync('process.argv[2]', JSON.stringify(out));
console.log(out.length);
