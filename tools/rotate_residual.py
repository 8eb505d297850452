#!/usr/bin/env python3
"""Rotate a Spark2_5 checkpoint's residual stream (a prototype of QuaRot / SpinQuant's R1, measured in
docs/FIDELITY.md, not kept).

Every RMSNorm gain is folded into the linears that read its output (q_k_v_proj and g_proj read
input_layernorm, gate_proj and up_proj post_attention_layernorm) and set to 1; then the residual
stream x becomes x·Q for an orthogonal Q = diag(±1)·H/√d (a randomized Walsh–Hadamard matrix; d must
be a power of two): the embedding E·Q, each linear that reads the stream W·diag(g)·Q, each that writes
to it (out_proj, down_proj) Qᵀ·W. RMSNorm commutes with an orthogonal Q once its gain is 1, so the
model computes the same function. The final norm's gain cannot stay beside a tied head, so the head is
untied: lm_head = E·diag(g_final)·Q (`tie_word_embeddings: false`). No online rotation is needed, so the
GPTQ format and vLLM's kernels are unchanged; the cost is the untied head's bytes.

    python3 tools/rotate_residual.py SRC DST [--seed N] [--identity]

Written in float32 as one file (exact to ~1e-7, KL ~1e-12 against SRC); `spark-tool quantize DST` then
quantizes the rotated weights. Holds the whole model in float64 while it works (≈ 14 GB for the 1.7B). `--identity` folds the gains and unties the head without rotating (the control).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

import st_numpy as st


def hadamard(n: int) -> np.ndarray:
    if n & (n - 1):
        raise SystemExit(f"hidden_size {n} is not a power of two: no Walsh–Hadamard matrix")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0, help="the random signs of Q")
    ap.add_argument("--identity", action="store_true", help="Q = I: fold the gains and untie only")
    a = ap.parse_args()
    if a.dst.exists():
        raise SystemExit(f"{a.dst} exists; choose a new folder")
    cfg = json.loads((a.src / "config.json").read_text())
    t = {k: v.astype(np.float64) for k, v in st.read_checkpoint(a.src).items()}
    if "lm_head.weight" in t:
        raise SystemExit("an untied head: only tied checkpoints are supported")
    d = cfg["hidden_size"]
    signs = np.random.default_rng(a.seed).choice([-1.0, 1.0], size=d)
    q = np.eye(d) if a.identity else signs[:, None] * hadamard(d)
    assert np.allclose(q @ q.T, np.eye(d))
    e = t["model.embedding.weight"]
    out = {
        "model.embedding.weight": e @ q,
        "lm_head.weight": (e * t["model.norm.weight"]) @ q,
        "model.norm.weight": np.ones(d),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm, readers in (("input_layernorm", ("self_attn.q_k_v_proj", "self_attn.g_proj")),
                              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            g = t[f"{p}{norm}.weight"]
            for r in readers:
                out[f"{p}{r}.weight"] = (t[f"{p}{r}.weight"] * g) @ q
            out[f"{p}{norm}.weight"] = np.ones(d)
        for w in ("self_attn.out_proj", "mlp.down_proj"):
            out[f"{p}{w}.weight"] = q.T @ t[f"{p}{w}.weight"]
    missing = set(t) - set(out)
    if any(k.endswith("self_attn.q_proj.weight") for k in missing):
        raise SystemExit("a split q/k/v checkpoint: this prototype folds into the fused q_k_v_proj only")
    if missing:
        raise SystemExit(f"tensors this prototype does not know: {sorted(missing)[:5]}")
    a.dst.mkdir(parents=True)
    st.write_file(a.dst / "model.safetensors", {k: ("F32", v.astype(np.float32)) for k, v in out.items()})
    cfg["tie_word_embeddings"] = False
    cfg["dtype"] = "float32"
    (a.dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in a.src.iterdir():
        # Everything but the weights (one file or shards and their index) and the config.
        weights = f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json"
        if f.is_file() and not weights and f.name != "config.json":
            shutil.copy(f, a.dst / f.name)
    print(f"wrote {a.dst} (Q = {'I' if a.identity else f'randomized Hadamard, seed {a.seed}'})")


if __name__ == "__main__":
    main()
