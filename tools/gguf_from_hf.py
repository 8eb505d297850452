#!/usr/bin/env python3
"""Write a Spark2_5 Hugging Face safetensors checkpoint as a llama.cpp GGUF (F32, F16 or BF16).

Why not llama.cpp's own `convert_hf_to_gguf.py`: it needs torch + transformers and identifies the
pre-tokenizer by hashing the encoding of a fixed text, which fails for checkpoints with their own small
tokenizer (fixtures/spark-tiny) or none at all (random full-shape checkpoints). This script writes the same
metadata keys and tensor names as the converter (`conversion/spark2_5.py` + `TextModel.set_gguf_parameters`
of llama.cpp 0c1e57098, docs/MODEL.md §16) with only `numpy` and the `gguf` package, and sets
`tokenizer.ggml.pre = "spark2_5"` directly.

- Input: single `model.safetensors` or shards + `model.safetensors.index.json`; BF16/F16/F32 tensors; fused
  `q_k_v_proj` or separate `q_proj`/`k_proj`/`v_proj` (fused into `attn_qkv`, the official layout, so
  llama-quantize picks the same per-tensor types as for the official GGUF); tied (no `output.weight`, the
  loader reuses `token_embd`) or untied (`lm_head.weight` -> `output.weight`).
- Output: 2-D tensors in --outtype, 1-D norms always F32 (as the converter). Bit-exact for a BF16 source
  written as BF16 or F32; BF16 -> F16 is exact except for values outside the F16 normal range.
- Streams: tensors are read from memory-mapped files and written one at a time (a tensor whose dtype already
  matches is copied straight from the map), so a 3.4 GB 1.7B checkpoint needs well under 1 GB of RAM.
- Tokenizer: `tokenizer.json` (+ `tokenizer_config.json` for special ids, add_bos, chat template) from the
  model folder or --tokenizer DIR. Ids with no token (e.g. a random 131072-vocab checkpoint written with the
  4096-token fixture tokenizer) become `[PADi]` UNUSED entries, as the converter does.

    python3 tools/gguf_from_hf.py fixtures/spark-tiny /tmp/spark-tiny-f32.gguf --outtype f32
    python3 tools/gguf_from_hf.py /tmp/spark-1.7b-random /tmp/spark-1.7b-bf16.gguf --outtype bf16 \\
        --tokenizer fixtures/spark-tiny
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
except ImportError:  # pragma: no cover - environment problem, not a bug
    sys.exit("error: the `gguf` package is missing: pip install -r tools/requirements-llama.txt")

ARCH = "spark2_5"
CHUNK_ELEMS = 1 << 24  # rows converted per step when a dtype change is needed (~64 MB of f32)


class InputError(Exception):
    pass


# ---------------------------------------------------------------- safetensors, memory-mapped

_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class LazyTensor:
    """A tensor inside a memory-mapped safetensors file; nothing is read until `.raw()`."""

    def __init__(self, path: Path, name: str, dtype: str, shape: list[int], offset: int, nbytes: int):
        if dtype not in _ST_DTYPES:
            raise InputError(f"{path.name}: tensor {name} has dtype {dtype}; only BF16, F16, F32 are supported")
        self.path, self.name, self.dtype, self.shape = path, name, dtype, tuple(shape)
        self.offset, self.nbytes = offset, nbytes
        want = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if want != nbytes:
            raise InputError(f"{path.name}: tensor {name} is {nbytes} bytes, shape {list(shape)} {dtype} needs {want}")

    def raw(self) -> np.ndarray:
        """The stored values as a read-only memmap (BF16 as uint16 bit patterns)."""
        return np.memmap(self.path, dtype=np.dtype(_ST_DTYPES[self.dtype]).newbyteorder("<"), mode="r",
                         offset=self.offset, shape=self.shape)


def open_safetensors(path: Path) -> dict[str, LazyTensor]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InputError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: bad safetensors header: {e}") from e
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = LazyTensor(path, name, info["dtype"], info["shape"], base + a, b - a)
    return out


def open_checkpoint(folder: Path) -> dict[str, LazyTensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, LazyTensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(open_safetensors(folder / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise InputError(f"{index}: tensors listed but absent from the shards: {missing[:5]}")
        return tensors
    single = folder / "model.safetensors"
    if not single.exists():
        raise InputError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    return open_safetensors(single)


# ---------------------------------------------------------------- dtype conversion

def to_f32(x: np.ndarray, src: str) -> np.ndarray:
    if src == "BF16":
        return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even (NaN stays NaN), as torch and gguf-py do."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


OUT_NP = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
OUT_GGML = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16}
FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}
SAME = {("BF16", "bf16"), ("F16", "f16"), ("F32", "f32")}


def convert(parts: list[LazyTensor], out: str) -> np.ndarray:
    """Row-concatenation of `parts` in dtype `out`; a memmap when no conversion or concatenation is needed."""
    if len(parts) == 1 and (parts[0].dtype, out) in SAME:
        return parts[0].raw()
    rows = sum(p.shape[0] for p in parts)
    cols = parts[0].shape[1:]
    dst = np.empty((rows, *cols), dtype=OUT_NP[out])
    r0 = 0
    for p in parts:
        src = p.raw()
        per_row = max(1, int(np.prod(cols, dtype=np.int64)))
        step = max(1, CHUNK_ELEMS // per_row)
        for a in range(0, p.shape[0], step):
            b = min(a + step, p.shape[0])
            if (p.dtype, out) in SAME:
                dst[r0 + a:r0 + b] = src[a:b]
                continue
            x = to_f32(src[a:b], p.dtype)
            if out == "bf16":
                dst[r0 + a:r0 + b] = f32_to_bf16_bits(x)
            elif out == "f16":
                with np.errstate(over="ignore"):
                    dst[r0 + a:r0 + b] = x.astype(np.float16)
            else:
                dst[r0 + a:r0 + b] = x
        r0 += p.shape[0]
    return dst


# ---------------------------------------------------------------- config and tensor plan

def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise InputError(f"{folder}: no config.json")
    c = json.loads(path.read_text())
    arches = c.get("architectures") or []
    if c.get("model_type") != "spark2_5" and "Spark2_5ForCausalLM" not in arches:
        raise InputError(f"{path}: not a Spark2_5 checkpoint (model_type {c.get('model_type')!r}, "
                         f"architectures {arches})")
    # The converter's own refusals (conversion/spark2_5.py).
    if c.get("hidden_act") != "gelu":
        raise InputError(f"{path}: hidden_act {c.get('hidden_act')!r}; Spark2_5 GGUF requires 'gelu'")
    if c.get("gate_attn_act_mode") != "sigmoid" or c.get("headwise_attn_output_gate") is not True:
        raise InputError(f"{path}: llama.cpp supports only head-wise sigmoid attention output gates")
    lt = c.get("layer_types") or []
    if len(lt) != c["num_hidden_layers"]:
        raise InputError(f"{path}: layer_types has {len(lt)} entries for {c['num_hidden_layers']} layers")
    bad = sorted(set(lt) - {"sliding_attention", "full_attention"})
    if bad:
        raise InputError(f"{path}: unsupported layer_types {bad}")
    rp = c.get("rope_parameters") or {}
    for kind in ("full_attention", "sliding_attention"):
        if kind not in rp or "rope_theta" not in rp[kind]:
            raise InputError(f"{path}: rope_parameters.{kind}.rope_theta is missing")
        if rp[kind].get("rope_type", "default") != "default":
            raise InputError(f"{path}: rope_parameters.{kind}.rope_type {rp[kind]['rope_type']!r}; only 'default'")
    return c


def plan_tensors(c: dict, st: dict[str, LazyTensor]) -> list[tuple[str, list[LazyTensor], bool]]:
    """(gguf name, source parts to row-concatenate, is_norm) in writing order; checks every shape."""
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ff, V, L = c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> LazyTensor:
        if name not in st:
            raise InputError(f"tensor {name} is missing")
        t = st[name]
        if t.shape != shape:
            raise InputError(f"tensor {name} has shape {list(t.shape)}, config implies {list(shape)}")
        used.add(name)
        return t

    plan = [("token_embd.weight", [get("model.embedding.weight", (V, H))], False),
            ("output_norm.weight", [get("model.norm.weight", (H,))], True)]
    tied = c.get("tie_word_embeddings", "lm_head.weight" not in st)
    if "lm_head.weight" in st:
        head = get("lm_head.weight", (V, H))
        if not tied:
            plan.append(("output.weight", [head], False))
        # tied + present: HF, vLLM and MLX ignore it; so does the converter (tied -> no output.weight).
    elif not tied:
        raise InputError("tie_word_embeddings is false but lm_head.weight is missing")
    for i in range(L):
        p = f"model.layers.{i}."
        if p + "self_attn.q_k_v_proj.weight" in st:
            qkv = [get(p + "self_attn.q_k_v_proj.weight", ((nh + 2 * nkv) * hd, H))]
        else:
            qkv = [get(p + "self_attn.q_proj.weight", (nh * hd, H)),
                   get(p + "self_attn.k_proj.weight", (nkv * hd, H)),
                   get(p + "self_attn.v_proj.weight", (nkv * hd, H))]
        plan += [
            (f"blk.{i}.attn_norm.weight", [get(p + "input_layernorm.weight", (H,))], True),
            (f"blk.{i}.attn_qkv.weight", qkv, False),
            (f"blk.{i}.attn_gate.weight", [get(p + "self_attn.g_proj.weight", (nh, H))], False),
            (f"blk.{i}.attn_output.weight", [get(p + "self_attn.out_proj.weight", (H, nh * hd))], False),
            (f"blk.{i}.ffn_norm.weight", [get(p + "post_attention_layernorm.weight", (H,))], True),
            (f"blk.{i}.ffn_gate.weight", [get(p + "mlp.gate_proj.weight", (ff, H))], False),
            (f"blk.{i}.ffn_up.weight", [get(p + "mlp.up_proj.weight", (ff, H))], False),
            (f"blk.{i}.ffn_down.weight", [get(p + "mlp.down_proj.weight", (H, ff))], False),
        ]
    extra = sorted(set(st) - used - {"lm_head.weight"})
    if extra:
        raise InputError(f"unexpected tensors (not Spark2_5, or biases/norms it does not have): {extra[:8]}"
                         + (" ..." if len(extra) > 8 else ""))
    return plan


# ---------------------------------------------------------------- tokenizer

def add_vocab(w: gguf.GGUFWriter, tok_dir: Path, vocab_size: int) -> int:
    path = tok_dir / "tokenizer.json"
    if not path.exists():
        raise InputError(f"{tok_dir}: no tokenizer.json (pass --tokenizer DIR with one; llama.cpp needs a vocab)")
    t = json.loads(path.read_text(encoding="utf-8"))
    if t.get("model", {}).get("type") != "BPE":
        raise InputError(f"{path}: model.type {t.get('model', {}).get('type')!r}; expected byte-level BPE")
    reverse = {i: s for s, i in t["model"]["vocab"].items()}
    added = {a["id"]: a for a in t.get("added_tokens", [])}
    for i, a in added.items():
        reverse[i] = a["content"]
    top = max(reverse)
    if top >= vocab_size:
        raise InputError(f"{path}: token id {top} >= vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        s = reverse[i]
        if i in added:
            looks_special = (s.startswith("<|") and s.endswith("|>")) or (s.startswith("<｜") and s.endswith("｜>"))
            if added[i].get("special") or looks_special:
                types.append(gguf.TokenType.CONTROL)
            else:
                s = s.replace("\u2581", " ")  # converter: pre-normalize user-defined spaces
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(s)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("spark2_5")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise InputError(f"{path}: no BPE merges")
    special.add_to_gguf(w, quiet=True)
    return len(reverse)


# ---------------------------------------------------------------- main

def write_gguf(model: Path, out: Path, outtype: str, tok_dir: Path, name: str | None) -> None:
    c = read_config(model)
    st = open_checkpoint(model)
    plan = plan_tensors(c, st)
    hd = c["head_dim"]
    rp = c["rope_parameters"]
    w = gguf.GGUFWriter(out, ARCH)
    w.add_name(name or model.resolve().name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(FILE_TYPE[outtype])
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(float(rp["full_attention"]["rope_theta"]))  # plain freq_base = FULL-attention theta
    w.add_rope_freq_base_swa(float(rp["sliding_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(c["vocab_size"])
    w.add_sliding_window(c["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])  # true = sliding
    w.add_rope_dimension_count(int(hd * float(rp["full_attention"].get("partial_rotary_factor", 1.0))))
    w.add_rope_dimension_count_swa(int(hd * float(rp["sliding_attention"].get("partial_rotary_factor", 1.0))))
    n_tok = add_vocab(w, tok_dir, c["vocab_size"])

    params = 0
    for gname, parts, is_norm in plan:
        t = "f32" if is_norm else outtype
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        n = int(np.prod(shape, dtype=np.int64))
        params += n
        w.add_tensor_info(gname, shape, np.dtype(OUT_NP[t]), n * np.dtype(OUT_NP[t]).itemsize, raw_dtype=OUT_GGML[t])
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for gname, parts, is_norm in plan:
        w.write_tensor_data(convert(parts, "f32" if is_norm else outtype))
    w.close()
    print(f"wrote {out}: {len(plan)} tensors, {params:,} parameters, {outtype.upper()} (norms F32), "
          f"{n_tok} tokens of {c['vocab_size']} from {tok_dir / 'tokenizer.json'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="HF checkpoint folder (config.json + safetensors)")
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--outtype", choices=["f32", "f16", "bf16"], default="bf16",
                    help="type of the 2-D tensors (norms are always F32); default bf16")
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: the model folder)")
    ap.add_argument("--name", help="general.name (default: the model folder's name)")
    a = ap.parse_args()
    try:
        write_gguf(a.model, a.out, a.outtype, a.tokenizer or a.model, a.name)
    except (InputError, OSError, KeyError, ValueError) as e:
        if a.out.exists():
            a.out.unlink()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
