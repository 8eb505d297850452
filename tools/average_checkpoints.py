#!/usr/bin/env python3
"""Average model-tuned GPTQ checkpoints that share their codes (a prototype of seed averaging).

`spark-tool quantize --set 'lab.model_tune={}'` (a `--features lab` build) moves only group scales and RMSNorm gains when its codes stay fixed
(the default), so runs with different `lab.model_tune.seed` differ only in those. This writes a checkpoint
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

import st_numpy as st


def header(path: Path) -> tuple[bytes, dict, int]:
    """The file's bytes, its header and where its data starts."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8:8 + n]), 8 + n


def encode(mean: np.ndarray, dtype: str) -> bytes:
    """The mean on the bf16 lattice, stored as `dtype` (BF16, or F16 holding a bf16 value exactly)."""
    bits = st.to_bf16_bits(mean)
    if dtype == "BF16":
        return bits.astype("<u2").tobytes()
    if dtype != "F16":
        sys.exit(f"averaging a {dtype} tensor is not supported")
    x = (bits.astype(np.uint32) << 16).view(np.float32)
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
    raw0, head0, base0 = header(ins[0] / "model.safetensors")
    tensors = [st.read_file(p / "model.safetensors") for p in ins]
    body = bytearray(raw0)
    averaged = 0
    for name, info in head0.items():
        if name == "__metadata__":
            continue
        parts = []
        for t, p in zip(tensors, ins):
            if name not in t or t[name].shape != tensors[0][name].shape or t[name].dtype != tensors[0][name].dtype:
                sys.exit(f"{p}: tensor {name} is missing or differs in shape or dtype from {ins[0]}")
            parts.append(t[name])
        if all(np.array_equal(q, parts[0]) for q in parts[1:]):
            continue
        if not (name.endswith(".scales") or name.endswith("norm.weight")):
            sys.exit(f"tensor {name} differs between the inputs: only scales and norm weights may")
        mean = np.mean([q.astype(np.float32) for q in parts], axis=0)
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
