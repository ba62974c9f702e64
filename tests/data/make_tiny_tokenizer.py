#!/usr/bin/env python3
"""Writes tests/data/models/qwen3-moe-tiny-chat: qwen3-moe-tiny's weights (copied) with a tiny
Hugging Face tokenizer that fits its 320-token vocabulary, so the daemon's text routes can be
tested end to end.

The tokenizer is a byte-level BPE as Qwen's and Llama 3's are: ids 0-255 are the 256 byte tokens
of the ByteLevel alphabet (GPT-2's bytes_to_unicode order), 256-311 are 56 merges learnt here on
a few English sentences, 312-319 are added tokens (<|endoftext|>, <|im_start|>, <|im_end|> and
others, special as Qwen marks them). The pre-tokenizer is Qwen2's Split regex then ByteLevel
without its own regex; the normalizer NFC. Unlike Qwen, the post-processor (TemplateProcessing)
puts <|endoftext|> first as a BOS, as Llama 3's puts <|begin_of_text|>, and the chat template
starts with {{ bos_token }}: so the tests see a text prompt get its BOS once, and a rendered
chat prompt keep its BOS without a second one (apply_chat_template encodes without special
tokens). tokenizer_config.json has a ChatML template in Qwen's style (with enable_thinking) and
eos <|im_end|>, whose id (314) config.json gives as eos_token_id.

Python 3 only, no packages. Deterministic: rerunning it writes the same files.
    python3 tests/data/make_tiny_tokenizer.py
"""

import collections
import json
import pathlib
import re
import shutil

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "models" / "qwen3-moe-tiny"
TARGET = HERE / "models" / "qwen3-moe-tiny-chat"

VOCAB_SIZE = 320
FIRST_ADDED = 312
MERGES = FIRST_ADDED - 256

# (content, special) at ids 312...
ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|vision_pad|>", True),
]
assert FIRST_ADDED + len(ADDED) == VOCAB_SIZE

# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen2.5 and Qwen3).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = """
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the woods. There is a tree on the hill, and the wind is in the trees. She said that the
weather is nice today; he thinks it will rain in the evening. What is the answer to the
question? The answer is in the text, and the text is on the screen. Hello there, how are you?
I am fine, thank you, and you? We are writing a tokenizer for the test of the server.
"""

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'assistant' and '</think>' in message.content %}\n"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "{%- else %}\n"
    "{%- set content = message.content %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n")


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable characters, in its order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [(b, chr(c)) for b, c in zip(bs, cs)]


def learn_merges(byte_map, count):
    """Plain BPE training: the most frequent adjacent pair (ties: the smaller pair) each round."""
    # A training-only approximation of the pre-tokenizer (Python's re has no \p{L}).
    words = re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+",
                       CORPUS)
    freq = collections.Counter("".join(byte_map[b] for b in w.encode()) for w in words)
    split = {w: list(w) for w in freq}
    merges = []
    while len(merges) < count:
        pairs = collections.Counter()
        for w, n in freq.items():
            s = split[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        for w in split:
            s, out, i = split[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    return merges


def main():
    order = bytes_to_unicode()
    byte_map = dict(order)
    vocab = {ch: i for i, (_, ch) in enumerate(order)}
    merges = learn_merges(byte_map, MERGES)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == FIRST_ADDED, len(vocab)

    added = [{
        "id": FIRST_ADDED + i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    } for i, (content, special) in enumerate(ADDED)]
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {
                "<|endoftext|>": {"id": "<|endoftext|>", "ids": [FIRST_ADDED],
                                  "tokens": ["<|endoftext|>"]}
            },
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                    "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in
                           ("content", "lstrip", "normalized", "rstrip", "single_word",
                            "special")} for t in added
        },
        "bos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }

    TARGET.mkdir(exist_ok=True)
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copyfile(SOURCE / name, TARGET / name)
    model_config = json.loads((SOURCE / "config.json").read_text())
    model_config["bos_token_id"] = FIRST_ADDED
    model_config["eos_token_id"] = FIRST_ADDED + 2  # <|im_end|>
    model_config["pad_token_id"] = FIRST_ADDED
    (TARGET / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    (TARGET / "tokenizer.json").write_text(
        json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n")
    (TARGET / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {TARGET}: {len(vocab)} BPE tokens ({MERGES} merges), "
          f"{len(added)} added tokens")


if __name__ == "__main__":
    main()
