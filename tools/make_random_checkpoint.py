#!/usr/bin/env python3
"""Write a random-weight Spark2_5 checkpoint in the HF layout.

Presets:
  fixture-random  the committed second fixture (fixtures/spark-random): a shape
                  deliberately unlike spark-tiny — untied head, 3 query heads /
                  1 KV head, head_dim 48 so q_dim (144) != hidden (128), partial
                  rotary 0.5 on full layers, split q/k/v projections, f16
                  linears with f32 norms, two shards + index, no tokenizer.
  1.7b / 4b       the real shapes (docs/MODEL.md §3, §15), bf16, tied head,
                  sharded; for scale and speed checks. Never commit these.

    python3 tools/make_random_checkpoint.py 1.7b /tmp/spark-1.7b-random
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import st_numpy  # noqa: E402

PRESETS = {
    "fixture-random": dict(hidden=128, inter=320, layers=["sliding_attention", "sliding_attention", "full_attention",
                                                          "sliding_attention", "full_attention"],
                           heads=3, kv=1, head_dim=48, vocab=1000, window=16, full_factor=0.5, full_theta=1e6,
                           tied=False, split_qkv=True, lin_dtype="F16", norm_dtype="F32", shards=2),
    "1.7b": dict(hidden=2048, inter=6656, layers=(["sliding_attention"] * 3 + ["full_attention"]) * 7,
                 heads=8, kv=2, head_dim=256, vocab=131072, window=512, full_factor=0.25, full_theta=5e6,
                 tied=True, split_qkv=False, lin_dtype="BF16", norm_dtype="BF16", shards=2),
    "4b": dict(hidden=2560, inter=10240, layers=(["sliding_attention"] * 3 + ["full_attention"]) * 9,
               heads=16, kv=4, head_dim=256, vocab=131072, window=512, full_factor=0.25, full_theta=5e6,
               tied=True, split_qkv=False, lin_dtype="BF16", norm_dtype="BF16", shards=5),
}


def config(p: dict) -> dict:
    return {
        "architectures": ["Spark2_5ForCausalLM"], "model_type": "spark2_5",
        "hidden_size": p["hidden"], "intermediate_size": p["inter"], "num_hidden_layers": len(p["layers"]),
        "num_attention_heads": p["heads"], "num_key_value_heads": p["kv"], "head_dim": p["head_dim"],
        "vocab_size": p["vocab"], "max_position_embeddings": 1048576, "sliding_window": p["window"],
        "layer_types": p["layers"],
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": p["full_factor"], "rope_theta": p["full_theta"],
                               "rope_type": "default"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000, "rope_type": "default"}},
        "rms_norm_eps": 1e-06, "hidden_act": "gelu", "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": p["tied"], "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "dtype": "bfloat16", "use_cache": True, "transformers_version": "4.57.1", "initializer_range": 0.02,
    }


def tensor_specs(p: dict):
    """(name, shape, kind) in checkpoint order; kind: emb | lin | norm."""
    H, I, q, kv = p["hidden"], p["inter"], p["heads"] * p["head_dim"], p["kv"] * p["head_dim"]
    yield "model.embedding.weight", (p["vocab"], H), "emb"
    for i in range(len(p["layers"])):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (H,), "norm"
        if p["split_qkv"]:
            yield pre + "self_attn.q_proj.weight", (q, H), "lin"
            yield pre + "self_attn.k_proj.weight", (kv, H), "lin"
            yield pre + "self_attn.v_proj.weight", (kv, H), "lin"
        else:
            yield pre + "self_attn.q_k_v_proj.weight", (q + 2 * kv, H), "lin"
        yield pre + "self_attn.g_proj.weight", (p["heads"], H), "lin"
        yield pre + "self_attn.out_proj.weight", (H, q), "lin"
        yield pre + "post_attention_layernorm.weight", (H,), "norm"
        yield pre + "mlp.gate_proj.weight", (I, H), "lin"
        yield pre + "mlp.up_proj.weight", (I, H), "lin"
        yield pre + "mlp.down_proj.weight", (H, I), "lin"
    yield "model.norm.weight", (H,), "norm"
    if not p["tied"]:
        yield "lm_head.weight", (p["vocab"], H), "lin"


def make(p: dict, rng: np.random.Generator, shape, kind) -> np.ndarray:
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    std = 1.0 if kind == "emb" else 1.0 / np.sqrt(shape[1])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="keep only the first N layers (per-layer benchmarks)")
    ap.add_argument("--layer-types", help="comma-separated sliding/full per layer, replacing the preset's "
                    "pattern (e.g. sliding,full: one layer of each type for export checks)")
    ap.add_argument("--tokenizer-from", type=Path,
                    help="copy tokenizer files from this checkpoint (its ids must fit the vocab), so text calibration works")
    a = ap.parse_args()
    p = dict(PRESETS[a.preset])
    if a.layers:
        p["layers"] = p["layers"][: a.layers]
    if a.layer_types:
        names = {"sliding": "sliding_attention", "full": "full_attention"}
        try:
            p["layers"] = [names[t.strip()] for t in a.layer_types.split(",")]
        except KeyError as e:
            ap.error(f"--layer-types: {e} is not sliding or full")
    a.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    specs = list(tensor_specs(p))
    total = sum(int(np.prod(s)) for _, s, _ in specs)
    # Split into shards of roughly equal parameter count, keeping tensor order.
    bounds, acc, shard = [], 0, 0
    for _, s, _ in specs:
        bounds.append(min(p["shards"] - 1, acc * p["shards"] // total))
        acc += int(np.prod(s))
    n = p["shards"]
    weight_map = {}
    for sh in range(n):
        fname = "model.safetensors" if n == 1 else f"model-{sh + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for (name, shape, kind), b in zip(specs, bounds):
            if b != sh:
                continue
            dtype = p["norm_dtype"] if kind == "norm" else p["lin_dtype"]
            tensors[name] = (dtype, make(p, rng, shape, kind))
            weight_map[name] = fname
        st_numpy.write_file(a.out / fname, tensors, {"format": "pt"})
        print(f"wrote {fname} ({len(tensors)} tensors)", flush=True)
    if n > 1:
        size = sum((a.out / f).stat().st_size for f in set(weight_map.values()))
        (a.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2) + "\n")
    (a.out / "config.json").write_text(json.dumps(config(p), indent=2) + "\n")
    if a.tokenizer_from:
        import shutil
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(a.tokenizer_from / f, a.out / f)
    print(f"{a.preset}: {len(specs)} tensors, {total:,} parameters -> {a.out}")


if __name__ == "__main__":
    main()
