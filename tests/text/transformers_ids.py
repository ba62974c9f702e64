#!/usr/bin/env python3
"""transformers' default encode of a corpus, for the cross-check in docs/text.md.

    python3 transformers_ids.py CORPUS.json OUT.json DIR...

CORPUS.json: a JSON list of strings (dump_corpus.mjs); each DIR holds tokenizer.json and
tokenizer_config.json. OUT.json: {"transformers": version, DIR: {"class", "ids"}}.
"""
import json
import sys

import transformers
from transformers import AutoTokenizer

texts = json.load(open(sys.argv[1]))
out = {"transformers": transformers.__version__}
for d in sys.argv[3:]:
    tok = AutoTokenizer.from_pretrained(d)
    out[d] = {"class": type(tok).__name__, "ids": [tok(x)["input_ids"] for x in texts]}
json.dump(out, open(sys.argv[2], "w"))
