"""Minimal safetensors reader/writer over numpy with bf16 support.

numpy has no bfloat16, and `safetensors.numpy` refuses BF16; this module
reads BF16/F16/F32 (and integer) tensors into numpy and writes BF16 by
round-to-nearest-even from float32. Sharded checkpoints are read through
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_NP = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


def read_file(path: Path) -> dict[str, np.ndarray]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[base + a:base + b]
        if info["dtype"] == "BF16":
            u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(_NP[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def read_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out = {}
        for f in files:
            out.update(read_file(folder / f))
        return out
    return read_file(folder / "model.safetensors")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns, round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def write_file(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """tensors: name -> (dtype, array) with dtype in BF16/F16/F32/I64. Written atomically."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        if dtype == "BF16":
            data = to_bf16_bits(arr).tobytes()
        else:
            data = np.ascontiguousarray(arr, dtype=np.dtype(_NP[dtype]).newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path = Path(path)
    tmp = path.with_name("." + path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    tmp.replace(path)
