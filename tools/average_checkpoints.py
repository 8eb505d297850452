#!/usr/bin/env python3
"""Average model-tuned GPTQ checkpoints that share their codes (a prototype of seed averaging).

`spark-tool quantize --model-tune` moves only group scales and RMSNorm gains when its codes stay fixed
(the default), so runs with different `--model-tune-seed` differ only in those. This writes a checkpoint
whose scales and norm weights are the mean of the inputs' (scales rounded to the bf16 lattice that model
tuning keeps them on, norms to bf16), every other byte copied from the first input; it refuses inputs
whose codes, zero points, group indices or shapes differ. docs/FIDELITY.md measures what it gives.

    python3 tools/average_checkpoints.py OUT IN1 IN2 [IN3 ...]
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np


def load(path: Path) -> tuple[bytes, dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8:8 + n]), 8 + n


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), returned as float32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def values(buf: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return np.frombuffer(buf, dtype="<f2").astype(np.float32)
    sys.exit(f"averaging a {dtype} tensor is not supported")


def encode(x: np.ndarray, dtype: str) -> bytes:
    x = bf16_round(x)
    if dtype == "BF16":
        return (x.view(np.uint32) >> 16).astype("<u2").tobytes()
    f = x.astype("<f2")
    if not np.array_equal(f.astype(np.float32), x):
        sys.exit("an averaged scale is not representable in fp16")
    return f.tobytes()


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    out, ins = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    if out.exists():
        sys.exit(f"{out} exists; choose a new folder")
    files = [load(p / "model.safetensors") for p in ins]
    raw0, head0, base0 = files[0]
    body = bytearray(raw0)
    averaged = 0
    for name, info in head0.items():
        if name == "__metadata__":
            continue
        parts = []
        for (raw, head, base), p in zip(files, ins):
            if head.get(name, {}).get("shape") != info["shape"] or head[name]["dtype"] != info["dtype"]:
                sys.exit(f"{p}: tensor {name} differs in shape or dtype from {ins[0]}")
            a, b = head[name]["data_offsets"]
            parts.append(raw[base + a:base + b])
        if all(q == parts[0] for q in parts[1:]):
            continue
        if not (name.endswith(".scales") or name.endswith("norm.weight")):
            sys.exit(f"tensor {name} differs between the inputs: only scales and norm weights may")
        mean = np.mean([values(q, info["dtype"]) for q in parts], axis=0)
        a, b = info["data_offsets"]
        body[base0 + a:base0 + b] = encode(mean, info["dtype"])
        averaged += 1
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ins[0], tmp)
    (tmp / "model.safetensors").write_bytes(bytes(body))
    tmp.rename(out)  # the folder appears complete or not at all
    print(f"{out}: {averaged} tensors averaged over {len(ins)} checkpoints")


if __name__ == "__main__":
    main()
