#!/usr/bin/env python3
"""Builds the tiny random reference models under tests/data/models with Hugging Face transformers.

Run on the GPU machine (it has PyTorch and transformers; nothing here needs the network):

    python3 tests/data/make_reference_models.py --out DIR

For every model it writes DIR/<name>/ with what `save_pretrained` writes (config.json,
model.safetensors, generation_config.json) and reference.json:

    {"transformers": version, "torch": version, "seed": s,
     "dtype": "float32" | "bfloat16" | "float16",
     "prompts": [{"ids": [...], "greedy": [...], "logits": "logits_0.npy",
                  "greedy_native": [...], "logits_native": "logits_native_0.npy"}]}

- `greedy`: the greedy continuation computed in float64 from the saved weights (the weights as
  saved, upcast; attention "eager", experts "eager": the grouped expert kernels have no float64).
- `logits`: float32 .npy of shape (len(ids) + len(greedy) - 1, vocab): row p is the float64 logits
  at position p of ids + greedy[:-1] (teacher-forced), rounded to float32.
- `greedy_native` / `logits_native` (bf16 models only): the same computed by transformers in the
  checkpoint's own dtype on the GPU, for information (what a user comparing with transformers in
  bf16 would see).

The weights are re-drawn after construction with larger scales than transformers' init (std 0.02
makes near-uniform logits whose greedy ties would be decided by rounding noise), seeded, so the
models are reproducible. The configs exercise what docs/design.md section 5 lists: Qwen3-MoE's
head_dim (≠ hidden / heads), q/k norms, mlp_only_layers and decoder_sparse_step, tied and untied heads;
Mixtral's top-2; DeepSeek-V2's MLA with and without q_lora_rank, YaRN (factor, mscale,
mscale_all_dim), greedy and group_limited_greedy routing, shared experts, dense first layers,
routed_scaling_factor and norm_topk_prob; DeepSeek-V3's sigmoid routing with its correction bias
(noaux_tc groups) and both rotary layouts (rope_interleave); a float16 checkpoint (Mixtral),
Qwen3's YaRN and attention_bias; Qwen2-MoE's q/k/v biases and sigmoid-gated shared expert.
"""
import argparse
import json
import math
import os
import sys
import traceback

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 320


def qwen3_moe(dtype, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, mlp_only_layers=[2], decoder_sparse_step=1,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
               tie_word_embeddings=False, router_aux_loss_coef=0.0, output_router_logits=False)
    cfg.update(kw)
    return transformers.Qwen3MoeConfig(**cfg), dtype


def mixtral(dtype, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
               max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False,
               router_aux_loss_coef=0.0, output_router_logits=False)
    cfg.update(kw)
    return transformers.MixtralConfig(**cfg), dtype


def qwen2_moe(dtype, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1, qkv_bias=True,
               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
               use_sliding_window=False, tie_word_embeddings=False, router_aux_loss_coef=0.0,
               output_router_logits=False)
    cfg.update(kw)
    return transformers.Qwen2MoeConfig(**cfg), dtype


def deepseek_v2(dtype, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
               v_head_dim=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
               first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy",
               norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
               tie_word_embeddings=False, aux_loss_alpha=0.0)
    cfg.update(kw)
    return transformers.DeepseekV2Config(**cfg), dtype


def deepseek_v3(dtype, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=48, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
               v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
               first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
               n_group=4, topk_group=2, rope_interleave=True, rms_norm_eps=1e-6,
               rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
    cfg.update(kw)
    return transformers.DeepseekV3Config(**cfg), dtype


YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

MODELS = {
    # fp32, untied, one dense layer (mlp_only_layers = [2]), norm_topk_prob.
    "qwen3-moe-tiny": lambda: qwen3_moe(torch.float32),
    # bf16, decoder_sparse_step 2 (layers 1 and 3 MoE), no renormalisation.
    "qwen3-moe-tiny-bf16": lambda: qwen3_moe(torch.bfloat16, norm_topk_prob=False,
                                             decoder_sparse_step=2, mlp_only_layers=[]),
    "mixtral-tiny": lambda: mixtral(torch.float32),
    # YaRN (factor 4 over 32 original positions, mscale 0.707 both), greedy top-3, 2 shared
    # experts, routed_scaling_factor 2.5, dense layer 0.
    "deepseek-v2-tiny-yarn": lambda: deepseek_v2(torch.float32, rope_scaling=dict(YARN),
                                                 routed_scaling_factor=2.5,
                                                 max_position_embeddings=128),
    # q_lora_rank, group_limited_greedy (4 groups, 2 kept), norm_topk_prob, 1 shared expert.
    "deepseek-v2-tiny-group": lambda: deepseek_v2(torch.float32, q_lora_rank=48,
                                                  topk_method="group_limited_greedy", n_group=4,
                                                  topk_group=2, num_experts_per_tok=2,
                                                  norm_topk_prob=True, n_shared_experts=1,
                                                  routed_scaling_factor=1.0),
    # fp32 with the head tied to the embedding (its embedding drawn smaller: a tied head over
    # N(0, 1) rows repeats the input token).
    "qwen3-moe-tiny-tied": lambda: qwen3_moe(torch.float32, tie_word_embeddings=True,
                                             num_hidden_layers=3, mlp_only_layers=[0]),
    # DeepSeek-V3: sigmoid scores with e_score_correction_bias (drawn, not zero), noaux_tc over 4
    # groups of 4 (2 kept), top-4 renormalised × 2.5, q_lora_rank, interleaved rotary.
    "deepseek-v3-tiny": lambda: deepseek_v3(torch.float32),
    # One group, no renormalisation, NeoX rotary (rope_interleave false), YaRN, no q_lora_rank,
    # 2 shared experts, top-3 of 8; weights drawn in bf16 and saved as float32 (BF16_WEIGHTS):
    # in bf16 its routing has near ties that rounding flips (transformers' own bf16 forward is
    # 24 % off its fp64 at single positions), so it is checked at fp32's bound instead.
    "deepseek-v3-tiny-neox": lambda: deepseek_v3(torch.bfloat16, n_routed_experts=8,
                                                 num_experts_per_tok=3, n_group=1, topk_group=1,
                                                 norm_topk_prob=False, routed_scaling_factor=1.0,
                                                 rope_interleave=False, q_lora_rank=None,
                                                 n_shared_experts=2, rope_scaling=dict(YARN),
                                                 max_position_embeddings=128),
    # float16: the checkpoint dtype the others leave out (weights and KV in half precision).
    "mixtral-tiny-f16": lambda: mixtral(torch.float16),
    # Qwen3's long-context setting (its model card: YaRN, factor 4 over 32768 positions), here
    # factor 4 over 32, no mscale keys (attention factor 0.1 ln 4 + 1), the prompts past 32.
    "qwen3-moe-tiny-yarn": lambda: qwen3_moe(torch.float32, max_position_embeddings=128,
                                             rope_scaling={"rope_type": "yarn", "type": "yarn",
                                                           "factor": 4.0,
                                                           "original_max_position_embeddings": 32}),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, no q/k norms, a shared expert
    # of its own width behind a sigmoid gate, top-2 of 8 not renormalised, a dense layer 1.
    "qwen2-moe-tiny": lambda: qwen2_moe(torch.float32),
    # bf16, one KV head per query head (group 1), decoder_sparse_step 2 (layers 1 and 3 MoE),
    # renormalised top-4. (With top-2 this seed's routing has near ties that bf16 rounding
    # flips: its first prompt came out 2.4 % off, transformers' own bf16 12.9 %.)
    "qwen2-moe-tiny-bf16": lambda: qwen2_moe(torch.bfloat16, num_key_value_heads=4,
                                             num_experts_per_tok=4, decoder_sparse_step=2,
                                             mlp_only_layers=[], norm_topk_prob=True),
    # Qwen3-MoE with attention_bias: biases on q, k, v and o.
    "qwen3-moe-tiny-bias": lambda: qwen3_moe(torch.float32, attention_bias=True,
                                             num_hidden_layers=3),
}

# Drawn in bf16, saved (and referenced) as float32: the same values, exactly.
BF16_WEIGHTS = {"deepseek-v3-tiny-neox"}

PROMPT_LENGTHS = (100, 37)
NEW_TOKENS = 20


def redraw(model, gen):
    """Seeded weights with scales that give peaked distributions."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):  # a parameter in some versions
                v = 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            elif name.endswith(".bias"):  # projection biases (Qwen2's q/k/v, attention_bias)
                v = 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            elif p.dim() == 1:  # norms (and biases)
                v = 1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            else:
                fan_in = p.shape[-1]
                gain = 1.0
                if "embed_tokens" in name:
                    # embeddings ~ N(0, 1); a tied head reuses them, so smaller there
                    tied = getattr(model.config, "tie_word_embeddings", False)
                    gain = (0.3 if tied else 1.0) * math.sqrt(fan_in)
                elif name.endswith("shared_expert_gate.weight"):
                    gain = 1.0  # Qwen2-MoE's sigmoid gate: values across (0, 1)
                elif name.endswith("gate.weight") and "proj" not in name:
                    gain = 3.0  # routers: distinct expert choices
                elif "lm_head" in name:
                    gain = 2.0
                v = torch.randn(p.shape, generator=gen, dtype=torch.float64) * (gain / math.sqrt(fan_in))
            p.copy_(v.to(p.dtype))
        # DeepSeek-V3's routing correction is a buffer, not a parameter: drawn so that it
        # reorders the choice (sigmoid scores lie in (0, 1)).
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.3 * torch.randn(b.shape, generator=gen, dtype=torch.float64)).to(b.dtype))


def forward_logits(model, ids, device):
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits[0]


def greedy(model, prompt, n, device):
    seq = list(prompt)
    for _ in range(n):
        logits = forward_logits(model, seq, device)
        seq.append(int(torch.argmax(logits[-1]).item()))
    return seq[len(prompt):]


def load(path, dtype, device):
    kwargs = dict(dtype=dtype, attn_implementation="eager")
    try:
        m = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return m.to(device).eval()


def build(name, out, device, seed):
    cfg, dtype = MODELS[name]()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 experts_implementation="eager")
    except TypeError:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    redraw(model, gen)
    model = model.to(dtype)
    if name in BF16_WEIGHTS:
        model, dtype = model.to(torch.float32), torch.float32
    d = os.path.join(out, name)
    model.save_pretrained(d, safe_serialization=True)

    rng = np.random.default_rng(seed)
    ref = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": seed,
           "dtype": str(dtype).replace("torch.", ""), "prompts": []}
    m64 = load(d, torch.float64, device)
    native = load(d, dtype, device) if dtype != torch.float32 else None
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = [int(t) for t in rng.integers(0, VOCAB, size=n)]
        g = greedy(m64, ids, NEW_TOKENS, device)
        logits = forward_logits(m64, ids + g[:-1], device).double().cpu().numpy().astype(np.float32)
        entry = {"ids": ids, "greedy": g, "logits": f"logits_{i}.npy"}
        np.save(os.path.join(d, entry["logits"]), logits)
        # Top-2 margins of the greedy choices, for the test's judgement of near ties.
        rows = logits[len(ids) - 1:]
        top2 = np.sort(rows, axis=1)[:, -2:]
        entry["greedy_margin_min"] = float((top2[:, 1] - top2[:, 0]).min())
        if native is not None:
            gn = greedy(native, ids, NEW_TOKENS, device)
            ln = forward_logits(native, ids + gn[:-1], device).float().cpu().numpy()
            entry["greedy_native"] = gn
            entry["logits_native"] = f"logits_native_{i}.npy"
            np.save(os.path.join(d, entry["logits_native"]), ln.astype(np.float32))
        ref["prompts"].append(entry)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(f"{name}: ok, greedy {[p['greedy'][:6] for p in ref['prompts']]}, "
          f"min margin {[round(p['greedy_margin_min'], 4) for p in ref['prompts']]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}")
    os.makedirs(a.out, exist_ok=True)
    failed = 0
    for name in a.only or MODELS:
        try:
            # The seed follows the model's place in MODELS, so --only rebuilds it identically.
            build(name, a.out, device, a.seed + list(MODELS).index(name))
        except Exception:
            failed += 1
            print(f"{name}: FAILED", flush=True)
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
