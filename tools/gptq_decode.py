#!/usr/bin/env python3
"""Decode a GPTQ v1 checkpoint with numpy only, written from docs/GPTQ_FORMAT.md §1–§2.

    python3 tools/gptq_decode.py CKPT                      # check structure, print a summary
    python3 tools/gptq_decode.py CKPT --compare DUMP       # bit-exact check against dequantized weights

qweight int32 [K/8, N]: code of input row k = 8r + j in bits 4j..4j+3 of word [r, n];
qzeros int32 [K/G, N/8] (v1 stores zero − 1); scales fp16 [K/G, N]; g_idx int32 [K];
w[n, k] = (q[k, n] − zero[g_idx[k], n]) · scale[g_idx[k], n].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import st_numpy  # noqa: E402


def unpack_along_rows(words: np.ndarray) -> np.ndarray:
    """[R, C] int32 → [8R, C] nibbles (row 8r + j from bits 4j..4j+3)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=1)  # [R, 8, C]
    return nib.reshape(-1, words.shape[1]).astype(np.int32)


def unpack_along_cols(words: np.ndarray) -> np.ndarray:
    """[R, C] int32 → [R, 8C] nibbles (column 8c + j from bits 4j..4j+3)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=2)  # [R, C, 8]
    return nib.reshape(words.shape[0], -1).astype(np.int32)


def dequantize(t: dict, prefix: str, checkpoint_format: str) -> np.ndarray:
    qweight, qzeros, scales, g_idx = (t[f"{prefix}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
    codes = unpack_along_rows(qweight)  # [K, N]
    zeros = unpack_along_cols(qzeros)  # [G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero − 1
    k, n = codes.shape
    assert scales.shape[1] == n and zeros.shape == scales.shape, prefix
    g = g_idx.astype(np.int64)
    w = (codes - zeros[g]).astype(np.float32) * scales.astype(np.float32)[g]  # [K, N]
    return np.ascontiguousarray(w.T)  # [N, K]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--compare", type=Path, help="safetensors of expected dequantized weights (NAME.weight [N, K] f32)")
    a = ap.parse_args()
    cfg = json.loads((a.checkpoint / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["sym"] and not qc["desc_act"], qc
    G = qc["group_size"]
    t = st_numpy.read_checkpoint(a.checkpoint)
    prefixes = sorted(n[: -len(".qweight")] for n in t if n.endswith(".qweight"))
    problems = []
    for p in prefixes:
        qz = t[f"{p}.qzeros"].astype(np.int64) & 0xFFFFFFFF
        if not np.all(qz == 0x77777777):
            problems.append(f"{p}: qzeros not all 0x77777777 (sym v1)")
        K = t[f"{p}.qweight"].shape[0] * 8
        if not np.array_equal(t[f"{p}.g_idx"], np.arange(K) // G):
            problems.append(f"{p}: g_idx is not k // {G}")
        if t[f"{p}.scales"].dtype != np.float16 or t[f"{p}.scales"].shape[0] != K // G:
            problems.append(f"{p}: scales must be fp16 [K/G, N]")
    expected = st_numpy.read_file(a.compare) if a.compare else {}
    compared = 0
    for name, want in expected.items():
        prefix = name[: -len(".weight")]
        if prefix not in prefixes:
            problems.append(f"{prefix}: in {a.compare} but not quantized in the checkpoint")
            continue
        got = dequantize(t, prefix, qc.get("checkpoint_format", "gptq"))
        if got.shape != want.shape or not np.array_equal(got.view(np.uint32), np.ascontiguousarray(want, dtype=np.float32).view(np.uint32)):
            diff = np.abs(got - want).max() if got.shape == want.shape else "shape"
            problems.append(f"{prefix}: decoded weights differ (max |Δ| {diff})")
        compared += 1
    if a.compare and compared != len(prefixes):
        problems.append(f"{len(prefixes)} quantized linears in the checkpoint but {compared} in {a.compare}")
    if problems:
        sys.exit("gptq_decode: FAILED\n  " + "\n  ".join(problems))
    print(f"gptq_decode: {len(prefixes)} GPTQ linears, group {G}, structure OK"
          + (f"; {compared} decoded bit-exactly" if a.compare else ""))


if __name__ == "__main__":
    main()
