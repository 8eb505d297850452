#!/usr/bin/env python3
"""Check a GGUF file written by spark-tool with llama.cpp's own Python package (`gguf`, pinned in
tools/requirements.txt), independently of spark-tool's reader.

    python3 tools/gguf_check.py FILE.gguf EXPECTED.safetensors
        Every tensor of EXPECTED (f32, GGUF tensor names; `spark-tool quantize --format gguf-*
        --dump-dequantized` writes it) must be in FILE and dequantize, with gguf.quants.dequantize,
        to exactly the same float32 bits. Exit 1 on any difference or missing tensor.
    python3 tools/gguf_check.py FILE.gguf --same-metadata REF.gguf
        Every metadata key and value of REF (e.g. tools/gguf_from_hf.py's file of the same model) must be
        in FILE with the same value, except general.file_type; FILE's extra keys must be spark_tool.*.
        The tensor names, order and shapes must match too.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf.quants import dequantize
except ImportError:  # pragma: no cover - environment problem
    sys.exit("error: the `gguf` package is missing: pip install -r tools/requirements.txt")


def read_f32_safetensors(path: Path) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise SystemExit(f"error: {path}: tensor {name} is {info['dtype']}, expected F32")
        a, b = info["data_offsets"]
        out[name] = np.memmap(path, dtype="<f4", mode="r", offset=base + a, shape=tuple(info["shape"]))
    return out


def field_value(f) -> object:
    v = f.contents()
    if isinstance(v, float):
        return np.float32(v).item()
    if isinstance(v, list) and v and isinstance(v[0], float):
        return [np.float32(x).item() for x in v]
    return v


def check_values(path: Path, expected: Path) -> int:
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    want = read_f32_safetensors(expected)
    bad = 0
    for name, w in want.items():
        t = tensors.get(name)
        if t is None:
            print(f"{name}: missing from {path}")
            bad += 1
            continue
        got = dequantize(t.data, t.tensor_type).astype(np.float32)
        if got.size != w.size:
            print(f"{name} ({t.tensor_type.name}): {got.size} values, expected {w.size}")
            bad += 1
            continue
        got = got.reshape(w.shape)
        diff = int(np.count_nonzero(got.view(np.uint32) != np.asarray(w).view(np.uint32)))
        if diff:
            print(f"{name} ({t.tensor_type.name}): {diff} of {w.size} values differ")
            bad += 1
    types = sorted({tensors[n].tensor_type.name for n in want if n in tensors})
    print(f"gguf_check: {len(want)} tensors ({', '.join(types)}) of {path.name} decoded by gguf "
          f"{getattr(gguf, '__version__', '')}: {'all bit-exact' if not bad else f'{bad} FAILED'}")
    return 1 if bad else 0


def check_metadata(path: Path, ref: Path) -> int:
    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(ref))
    skip = {"general.file_type"}
    ours = {k: f for k, f in a.fields.items() if not k.startswith("GGUF.")}
    theirs = {k: f for k, f in b.fields.items() if not k.startswith("GGUF.")}
    bad = []
    for k, f in theirs.items():
        if k in skip:
            continue
        if k not in ours:
            bad.append(f"{k}: missing")
        elif [int(x) for x in ours[k].types] != [int(x) for x in f.types]:
            bad.append(f"{k}: type {ours[k].types} vs {f.types}")
        elif field_value(ours[k]) != field_value(f):
            bad.append(f"{k}: value differs ({str(field_value(ours[k]))[:60]} vs {str(field_value(f))[:60]})")
    extra = [k for k in ours if k not in theirs and not k.startswith("spark_tool.")]
    bad += [f"{k}: not in the reference" for k in extra]
    names_a = [(t.name, [int(x) for x in t.shape]) for t in a.tensors]
    names_b = [(t.name, [int(x) for x in t.shape]) for t in b.tensors]
    if names_a != names_b:
        bad.append(f"tensor names/order/shapes differ: {names_a[:3]}... vs {names_b[:3]}...")
    for line in bad:
        print(line)
    print(f"gguf_check: metadata of {path.name} vs {ref.name}: {len(theirs)} keys, "
          f"{len(names_b)} tensors: {'identical' if not bad else f'{len(bad)} differences'}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("expected", type=Path, nargs="?", help="f32 safetensors of the expected values")
    ap.add_argument("--same-metadata", type=Path, metavar="REF", help="compare metadata and tensor names with REF")
    a = ap.parse_args()
    if (a.expected is None) == (a.same_metadata is None):
        ap.error("give EXPECTED or --same-metadata REF")
    if a.same_metadata:
        return check_metadata(a.gguf, a.same_metadata)
    return check_values(a.gguf, a.expected)


if __name__ == "__main__":
    sys.exit(main())
