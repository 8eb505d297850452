#!/usr/bin/env python3
"""llama.cpp Q4_K_M / Q8_0 of a Spark2_5 checkpoint, scored with `spark-tool parity`'s metrics on the same tokens.

Why: docs/FIDELITY.md measures our GPTQ W4A8/W4A16 artifacts against the original with `spark-tool parity`;
the peer a user would otherwise pick is llama.cpp's Q4_K_M (or Q8_0). spark-tool cannot run a GGUF, so this
script drives llama.cpp through its Python bindings (llama-cpp-python, which vendors llama.cpp with the
`spark2_5` architecture) and recomputes parity's metrics in numpy on exactly the token sequences parity uses.

What it does:
  1. GGUFs: tools/gguf_from_hf.py writes the checkpoint as BF16 (bit-exact; the quantization source, as in
     the official BF16 -> quant pipeline), F16 (llama.cpp's usual full-precision baseline) and F32 (exact
     weights and f32 activations: the gap to our reference is then llama.cpp's numerics alone, mostly its
     tanh-GELU GEGLU against the checkpoint's exact erf, docs/MODEL.md §10). `llama_model_quantize` makes
     Q8_0, Q4_0 and Q4_K_M (each type's default per-tensor mix), and Q4_0 / Q4_K_M again with an importance
     matrix: llama.cpp's `llama-imatrix` (--llama-imatrix) over --imatrix-tokens tokens of --imatrix-text
     (default: the calibration text and token count `spark-tool quantize` uses by default), passed to
     `llama_model_quantize` as llama-quantize does (per tensor in_sum2 / counts). --no-imatrix skips them.
  2. Token ids and the reference come from spark-tool, never from this script: prompts of
     calibration/parity_prompts.json are tokenized (chat frame included) by `spark-tool run --chat ...
     --max-new-tokens 0 --logits-out`, the reference's greedy continuations by `spark-tool run --tokens ...
     --max-new-tokens N --logits-out`, teacher-forced logits by `spark-tool run --tokens SEQ
     --max-new-tokens 0 --logits-out` (one full forward, as parity), held-out documents are tokenized the
     same way and cut into windows as `calibration::build` does.
  3. Metrics as src/parity.rs: per prompt, greedy continuation (<= --max-new-tokens, stop at the reference
     config's EOS; identical or not); teacher forcing on prompt + the REFERENCE's continuation, all positions
     but the last: KL(ref||cand) from float64 log-softmax of the f32 logits (clamped at 0), top-1 agreement,
     top-5 overlap (ties broken to the lower id); overall KL mean, KL p99 (sorted[ceil(0.99 n) - 1]);
     perplexity ratio cand/ref on --eval-tokens held-out tokens in --eval-seq-len windows.
  4. llama.cpp runs: one context per GGUF, all logits kept; a teacher-forced sequence is one batch (one
     forward, like ours); greedy = argmax of llama.cpp's logits (lowest id on ties), prefill then one token
     per step. KV cache f16 and flash attention on (llama.cpp's CPU defaults), --threads threads.
  5. Comparisons: every llama.cpp file vs our reference (spark-tool on the original, f32); the quants also
     vs llama.cpp's own F16 run (then the F16 run is the reference: its greedy continuations, its logits).
     bpw = bits of all GGUF tensor data / parameters (tied head counted once, i.e. the checkpoint's
     parameters), and over the five quantized linears per layer only (attn_qkv, attn_output, ffn_gate,
     ffn_up, ffn_down).
  --ours CKPT adds rows for our own quantized checkpoints straight from `spark-tool parity --json` (same
  run, same prompts), so one command prints the whole comparison table.

--self-check CKPT proves the numpy metrics are parity's: it scores CKPT (e.g. `spark-tool quantize --format
w4a16 --group-size 128 --out /tmp/q128`) against --model with spark-tool as both engines, runs `spark-tool
parity --json` on the same pair, and requires every figure to agree at the precision the tables print
(exit 1 otherwise). It needs no llama.cpp.

    pip install -r tools/requirements-llama.txt        # builds llama.cpp (10-40 min on 2 cores)
    python3 tools/llamacpp_fidelity.py --self-check /tmp/q128 --w4-numerics w4a8
    python3 tools/llamacpp_fidelity.py --work /tmp/llf --ours /tmp/fid/gptq-search-g128 --json /tmp/llf/r.json

The fixture is small enough that every spark-tool call (one process per sequence) takes well under a second;
for a full-size model use a smaller prompt set.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LINEARS = ("attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Fail(Exception):
    pass


# ---------------------------------------------------------------- safetensors (spark-tool --logits-out)

def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": "<f4", "I64": "<i8", "F16": "<f2", "I32": "<i4"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=kinds[info["dtype"]]).reshape(info["shape"])
    return out, header.get("__metadata__", {})


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


# ---------------------------------------------------------------- engines

class Engine:
    """Greedy continuations and all-position logits, cached per sequence."""

    name = "?"

    def __init__(self):
        self._logits: dict[tuple[int, ...], np.ndarray] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def logits(self, seq: list[int]) -> np.ndarray:
        key = tuple(seq)
        if key not in self._logits:
            self._logits[key] = self._compute_logits(seq)
        return self._logits[key]

    def greedy(self, prompt: list[int], n: int, stop: set[int]) -> list[int]:
        key = (n, *sorted(stop), -1, *prompt)
        if key not in self._greedy:
            self._greedy[key] = self._compute_greedy(prompt, n, stop)
        return self._greedy[key]

    def _compute_logits(self, seq: list[int]) -> np.ndarray:
        raise NotImplementedError

    def _compute_greedy(self, prompt: list[int], n: int, stop: set[int]) -> list[int]:
        raise NotImplementedError


class SparkTool(Engine):
    """`spark-tool run` on a checkpoint folder; one process per call."""

    def __init__(self, binary: str, model: Path, extra: list[str], name: str):
        super().__init__()
        self.binary, self.model, self.extra, self.name = binary, model, extra, name
        self.tmp = Path(tempfile.mkdtemp(prefix="llamacpp-fid-"))
        atexit.register(shutil.rmtree, self.tmp, True)

    def run(self, args: list[str], n_new: int) -> tuple[list[int], int, np.ndarray]:
        out = self.tmp / "out.safetensors"
        cmd = [self.binary, "run", str(self.model), *args, *self.extra, "--max-new-tokens", str(n_new),
               "--quiet", "--logits-out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            short = " ".join(cmd[:4]) + (" ..." if len(cmd) > 4 else "")
            raise Fail(f"`{short}` failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        t, meta = read_safetensors(out)
        return t["tokens"].astype(np.int64).tolist(), int(meta["prompt_len"]), t["prompt_logits"]

    def encode(self, text: str, chat: bool = False, system: str | None = None, thinking: bool = True) -> list[int]:
        if text == "":
            return []
        args = ["--prompt=" + text]
        if chat:
            args.append("--chat")
            if system is not None:
                args.append("--system=" + system)
            if not thinking:
                args.append("--no-think")
        toks, plen, _ = self.run(args, 0)
        assert plen == len(toks)
        return toks

    def _compute_logits(self, seq):
        toks, plen, logits = self.run(["--tokens=" + ",".join(map(str, seq))], 0)
        if toks != list(seq) or logits.shape[0] != len(seq):
            raise Fail(f"{self.name}: spark-tool returned {len(toks)} tokens / {logits.shape[0]} rows for {len(seq)}")
        return logits

    def _compute_greedy(self, prompt, n, stop):
        # spark-tool stops at its own checkpoint's EOS ids; parity uses the reference's.
        if stop_ids(self.model) != stop:
            raise Fail(f"{self.model}: EOS ids {sorted(stop_ids(self.model))} differ from the reference's {sorted(stop)}")
        toks, plen, _ = self.run(["--tokens=" + ",".join(map(str, prompt))], n)
        return toks[plen:]


class LlamaCpp(Engine):
    """A GGUF through llama-cpp-python: one context, every logit kept."""

    def __init__(self, path: Path, n_ctx: int, threads: int, flash_attn: bool, name: str, extra_bufts: bool):
        super().__init__()
        import llama_cpp.llama_cpp as low  # the module llama_cpp.Llama reads its defaults from
        from llama_cpp import Llama
        self.name, self.path = name, path
        # Weight repacking into "extra buffer types" (AMX / AVX tiles) is a speed feature; on an AMX machine
        # llama-cpp-python 0.3.36's repacked Q4_0/Q8_0 path dies with SIGILL at its first `tilezero`, so it
        # is off unless --extra-bufts on. Llama() takes no such argument: its default params are patched.
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = extra_bufts
            return p
        low.llama_model_default_params = params
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                         n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
        low.llama_model_default_params = default
        self.n_ctx = n_ctx

    def _eval_fresh(self, seq: list[int]) -> None:
        if len(seq) > self.n_ctx:
            raise Fail(f"{self.name}: sequence of {len(seq)} tokens > --n-ctx {self.n_ctx}")
        self.llm.reset()
        self.llm.eval(seq)

    def _compute_logits(self, seq):
        self._eval_fresh(seq)
        return np.array(self.llm.scores[:len(seq)], dtype=np.float32, copy=True)

    def _compute_greedy(self, prompt, n, stop):
        self._eval_fresh(prompt)
        out: list[int] = []
        for i in range(n):
            last = self.llm.scores[self.llm.n_tokens - 1]
            nxt = int(np.argmax(last))  # first maximum = lowest id, as spark-tool's greedy
            out.append(nxt)
            if nxt in stop or i + 1 == n:
                break
            if self.llm.n_tokens + 1 > self.n_ctx:
                raise Fail(f"{self.name}: greedy ran past --n-ctx {self.n_ctx}")
            self.llm.eval([nxt])
        return out


# ---------------------------------------------------------------- what parity evaluates

def read_documents(path: Path) -> list[str]:
    """calibration::read_documents: .jsonl -> the "text" of each non-blank line; anything else -> one doc."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        v = json.loads(line)
        if not isinstance(v, dict) or not isinstance(v.get("text"), str):
            raise Fail(f"{path} line {i + 1}: expected a JSON object with a string field \"text\"")
        docs.append(v["text"])
    return docs


class Plan:
    """Prompt ids (spark-tool's tokenization of parity's prompt set) and the held-out windows."""

    def __init__(self, tok: SparkTool, prompts: Path, eval_text: Path, eval_tokens: int, eval_seq_len: int):
        spec = json.loads(prompts.read_text(encoding="utf-8"))["prompts"]
        self.prompts: list[tuple[str, list[int]]] = []
        for p in spec:
            if ("text" in p) == ("tokens" in p):
                raise Fail(f"{prompts}: prompt {p.get('name')!r} needs exactly one of text / tokens")
            if "tokens" in p:
                ids = [int(t) for t in p["tokens"]]
            else:
                ids = tok.encode(p["text"], p.get("chat", False), p.get("system"), p.get("thinking", True))
            self.prompts.append((p["name"], ids))
        self.windows: list[list[int]] = []
        if eval_tokens > 0:
            seq = max(2, min(eval_seq_len, eval_tokens))
            samples = eval_tokens // seq
            need = samples * seq
            stream: list[int] = []
            for doc in read_documents(eval_text):
                if len(stream) >= need:
                    break
                stream += tok.encode(doc)
            if need == 0 or len(stream) < need:
                raise Fail(f"{eval_text}: {len(stream)} tokens, {need} needed")
            self.windows = [stream[s * seq:(s + 1) * seq] for s in range(samples)]


# ---------------------------------------------------------------- metrics (src/parity.rs)

def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True).astype(np.float64)
    x = x.astype(np.float64)
    return x - (np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m)


def top5(x: np.ndarray) -> np.ndarray:
    return np.argsort(-x, axis=-1, kind="stable")[:, :5]


class Acc:
    def __init__(self):
        self.kls: list[np.ndarray] = []
        self.top1 = self.top5 = 0
        self.max_abs = self.sig = self.noise = 0.0

    def add(self, r: np.ndarray, c: np.ndarray) -> None:
        lr, lc = log_softmax(r), log_softmax(c)
        self.kls.append(np.maximum((np.exp(lr) * (lr - lc)).sum(axis=-1), 0.0))
        tr, tc = top5(r), top5(c)
        self.top1 += int((tr[:, 0] == tc[:, 0]).sum())
        self.top5 += int((tr[:, :, None] == tc[:, None, :]).any(axis=2).sum())
        d = np.abs(r.astype(np.float64) - c.astype(np.float64))
        self.max_abs = max(self.max_abs, float(d.max()))
        self.sig += float((r.astype(np.float64) ** 2).sum())
        self.noise += float((d * d).sum())

    def n(self) -> int:
        return sum(len(k) for k in self.kls)

    def all_kls(self) -> np.ndarray:
        return np.concatenate(self.kls) if self.kls else np.zeros(0)

    def snr_db(self) -> float:
        return math.inf if self.noise == 0 else 10 * math.log10(self.sig / self.noise)


def perplexity(e: Engine, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for w in windows:
        ls = log_softmax(e.logits(w))
        nll -= float(ls[np.arange(len(w) - 1), np.asarray(w[1:])].sum())
        n += len(w) - 1
    return math.exp(nll / max(n, 1))


def compare(ref: Engine, cand: Engine, plan: Plan, max_new: int, stop: set[int]) -> dict:
    total, prompts, div_sum = Acc(), [], 0
    for name, ids in plan.prompts:
        gr, gc = ref.greedy(ids, max_new, stop), cand.greedy(ids, max_new, stop)
        first = next((i for i, (a, b) in enumerate(zip(gr, gc)) if a != b), None)
        if first is None and len(gr) != len(gc):
            first = min(len(gr), len(gc))
        div_sum += len(gr) if first is None else first
        seq = ids + gr
        n = max(len(seq) - 1, 1)
        lr, lc = ref.logits(seq)[:n], cand.logits(seq)[:n]
        acc = Acc()
        acc.add(lr, lc)
        total.add(lr, lc)
        kl = acc.all_kls()
        prompts.append(dict(name=name, prompt_tokens=len(ids), greedy_identical=first is None,
                            first_divergence=first, positions=acc.n(), top1=acc.top1 / acc.n(),
                            top5=acc.top5 / (5 * acc.n()), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                            max_abs_dlogit=acc.max_abs, snr_db=acc.snr_db()))
    kls = np.sort(total.all_kls())
    n = total.n()
    p99 = float(kls[max(math.ceil(n * 0.99) - 1, 0)]) if n else 0.0
    if plan.windows:
        ppl_r, ppl_c = perplexity(ref, plan.windows), perplexity(cand, plan.windows)
    else:
        ppl_r = ppl_c = math.nan
    overall = dict(greedy_identical=sum(p["greedy_identical"] for p in prompts), prompts=len(prompts),
                   mean_tokens_to_divergence=div_sum / len(prompts), positions=n, top1=total.top1 / n,
                   top5=total.top5 / (5 * n), kl_mean=float(kls.mean()), kl_p99=p99, kl_max=float(kls[-1]),
                   max_abs_dlogit=total.max_abs, snr_db=total.snr_db(),
                   eval_tokens=sum(len(w) for w in plan.windows), ppl_reference=ppl_r, ppl_candidate=ppl_c,
                   ppl_ratio=ppl_c / ppl_r)
    return dict(reference=ref.name, candidate=cand.name, max_new_tokens=max_new, prompts=prompts, overall=overall)


# ---------------------------------------------------------------- bits per weight

def gguf_bpw(path: Path) -> dict:
    import gguf
    r = gguf.GGUFReader(str(path))
    bits = params = lin_bits = lin_params = 0
    types: dict[str, int] = {}
    per: dict[str, str] = {}
    for t in r.tensors:
        bits += int(t.n_bytes) * 8
        params += int(t.n_elements)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.rsplit(".", 1)[0]
        per.setdefault(kind, set()).add(t.tensor_type.name)
        if kind in LINEARS:
            lin_bits += int(t.n_bytes) * 8
            lin_params += int(t.n_elements)
    return dict(bpw=bits / params, bpw_linears=lin_bits / lin_params, parameters=params, tensor_bytes=bits // 8,
                file_bytes=path.stat().st_size, tensor_types=types,
                types_by_tensor={k: sorted(v) for k, v in per.items()})


def gguf_types(path: Path) -> dict[str, str]:
    import gguf
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def gguf_file_type(path: Path) -> int | None:
    import gguf
    f = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    return int(f.contents()) if f is not None else None


def gptq_bpw(ckpt: Path) -> dict:
    """Like `spark-tool inspect` (qweight+qzeros+scales+g_idx per GPTQ linear), plus the linears alone."""
    files = ([ckpt / "model.safetensors"] if (ckpt / "model.safetensors").exists() else
             [ckpt / f for f in sorted(set(json.loads((ckpt / "model.safetensors.index.json").read_text())
                                            ["weight_map"].values()))])
    entries = {}
    for f in files:
        for k, v in safetensors_header(f).items():
            if k != "__metadata__":
                entries[k] = v
    bits = params = lin_bits = lin_params = 0
    for k, v in entries.items():
        nbytes = v["data_offsets"][1] - v["data_offsets"][0]
        if k.endswith(".qweight"):
            prefix = k[: -len(".qweight")]
            q = [entries.get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")]
            b = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in q if e)
            n = v["shape"][0] * 8 * v["shape"][1]  # GPTQ v1 4-bit: [in / 8, out] int32
            bits, params, lin_bits, lin_params = bits + 8 * b, params + n, lin_bits + 8 * b, lin_params + n
        elif k.rsplit(".", 1)[-1] in ("qzeros", "scales", "g_idx"):
            continue
        else:
            bits += 8 * nbytes
            params += int(np.prod(v["shape"], dtype=np.int64))
    return dict(bpw=bits / params, bpw_linears=lin_bits / max(lin_params, 1), parameters=params)


# ---------------------------------------------------------------- the pipeline

def find_spark_tool(arg: str | None) -> str:
    if arg is not None:
        if not (Path(arg).is_file() and os.access(arg, os.X_OK)):
            raise Fail(f"--spark-tool {arg}: not an executable file")
        return arg
    for cand in (os.environ.get("SPARK_TOOL"), str(ROOT / "target/release/spark-tool"), shutil.which("spark-tool")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise Fail("no spark-tool binary: build it (cargo build --release) or pass --spark-tool PATH / set SPARK_TOOL")


def stop_ids(model: Path) -> set[int]:
    e = json.loads((model / "config.json").read_text()).get("eos_token_id", [])
    return set(e if isinstance(e, list) else [e])


def parity_json(a, binary: str, cand: Path, numerics: str, out: Path) -> dict:
    cmd = [binary, "parity", str(a.model), str(cand), "--json", str(out), "--max-new-tokens", str(a.max_new_tokens),
           "--eval-tokens", str(a.eval_tokens), "--eval-seq-len", str(a.eval_seq_len)]
    if a.prompts:
        cmd += ["--prompts", str(a.prompts)]
    if a.eval_text:
        cmd += ["--eval-text", str(a.eval_text)]
    if numerics != "auto":
        cmd += ["--w4-numerics", numerics]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 1):  # 1 = drift against a policy; there is none here
        raise Fail(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())


PRINTED = [  # (key, format) as docs/FIDELITY.md prints them
    ("kl_mean", "{:.2e}"), ("kl_p99", "{:.2e}"), ("top1", "{:.4f}"), ("top5", "{:.4f}"),
    ("greedy_identical", "{}"), ("ppl_ratio", "{:.4f}"),
]


def row(label: str, vs: str, bpw: dict, o: dict) -> str:
    return (f"| {label} | {vs} | {bpw['bpw']:.3f} | {bpw['bpw_linears']:.3f} | {o['kl_mean']:.2e} | {o['kl_p99']:.2e} "
            f"| {o['top1']:.4f} | {o['top5']:.4f} | {o['greedy_identical']}/{o['prompts']} | {o['ppl_ratio']:.4f} |")


HEADER = ("| candidate | vs | bpw (all tensors) | bpw (linears) | KL mean | KL p99 | top-1 | top-5 | greedy | ppl ratio |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def self_check(a, binary: str) -> int:
    ref = SparkTool(binary, a.model, [], "spark-tool reference")
    extra = [] if a.w4_numerics == "auto" else ["--w4-numerics", a.w4_numerics]
    cand = SparkTool(binary, a.self_check, extra, f"spark-tool {a.self_check}")
    plan = make_plan(a, ref)
    mine = compare(ref, cand, plan, a.max_new_tokens, stop_ids(a.model))
    mine["candidate_bpw"] = gptq_bpw(a.self_check)["bpw"]
    theirs = parity_json(a, binary, a.self_check, a.w4_numerics, ref.tmp / "parity.json")
    mo, to = mine["overall"], theirs["overall"]
    ok = True
    print(f"{'figure':<22} {'python':>24} {'spark-tool parity':>24}  printed")
    checks = [(k, f, mo[k], to[k]) for k, f in PRINTED] + [
        ("positions", "{}", mo["positions"], to["positions"]), ("prompts", "{}", mo["prompts"], to["prompts"]),
        ("eval_tokens", "{}", mo["eval_tokens"], to["eval_tokens"]),
        ("ppl_reference", "{:.4f}", mo["ppl_reference"], to["ppl_reference"]),
        ("ppl_candidate", "{:.4f}", mo["ppl_candidate"], to["ppl_candidate"]),
        ("snr_db", "{:.1f}", mo["snr_db"], to["snr_db"]),
        ("candidate_bpw", "{:.3f}", mine["candidate_bpw"], theirs["candidate_bpw"])]
    for k, f, x, y in checks:
        same = f.format(x) == f.format(y)
        ok &= same
        print(f"{k:<22} {x!r:>24} {y!r:>24}  {'same' if same else 'DIFFERENT'}")
    for p, q in zip(mine["prompts"], theirs["prompts"]):
        for k in ("name", "prompt_tokens", "greedy_identical", "first_divergence", "positions", "top1", "top5"):
            if p[k] != q[k]:
                ok = False
                print(f"prompt {p['name']}: {k} python {p[k]!r} vs parity {q[k]!r}")
        if f"{p['kl_mean']:.6e}" != f"{q['kl_mean']:.6e}":
            ok = False
            print(f"prompt {p['name']}: kl_mean python {p['kl_mean']!r} vs parity {q['kl_mean']!r}")
    rel = abs(mo["kl_mean"] - to["kl_mean"]) / to["kl_mean"]
    print(f"relative difference of KL mean: {rel:.1e}; per-prompt ids, greedy, top-1/top-5 counts compared exactly")
    print("SELF-CHECK PASSED: the numpy metrics reproduce spark-tool parity" if ok else "SELF-CHECK FAILED")
    return 0 if ok else 1


def make_plan(a, tok: SparkTool) -> Plan:
    t = time.time()
    plan = Plan(tok, a.prompts or ROOT / "calibration/parity_prompts.json",
                a.eval_text or ROOT / "calibration/heldout.jsonl", a.eval_tokens, a.eval_seq_len)
    print(f"plan: {len(plan.prompts)} prompts ({sum(len(i) for _, i in plan.prompts)} prompt tokens), "
          f"{len(plan.windows)} held-out windows ({time.time() - t:.1f} s)", file=sys.stderr)
    return plan


def quantize(src: Path, dst: Path, ftype: int, threads: int, imatrix: Path | None = None) -> None:
    """`llama_model_quantize` with the default per-tensor recipe of `ftype`; with an imatrix file (made by
    llama-imatrix) as tools/quantize/quantize.cpp passes it: per tensor, in_sum2 / counts (1 where no count)."""
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, threads
    keep = []
    if imatrix is not None:
        import gguf
        t = {x.name: np.asarray(x.data, dtype=np.float32).ravel() for x in gguf.GGUFReader(str(imatrix)).tensors}
        names = sorted(n[: -len(".in_sum2")] for n in t if n.endswith(".in_sum2"))
        if not names:
            raise Fail(f"{imatrix}: no <tensor>.in_sum2 entries (not a GGUF imatrix)")
        arr = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()  # last entry zeroed: terminator
        for i, n in enumerate(names):
            s, c = t[n + ".in_sum2"], t[n + ".counts"]
            s = s.reshape(c.size, -1)
            v = np.where(c[:, None] > 0, s / np.where(c > 0, c, 1)[:, None], np.float32(1)).astype(np.float32).ravel()
            keep.append((n.encode(), v))
            arr[i].name, arr[i].size = keep[-1][0], v.size
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0 or not dst.exists():
        raise Fail(f"llama_model_quantize {src} -> {dst} failed ({rc})")


def make_imatrix(a, gguf_path: Path, out: Path) -> dict:
    """llama-imatrix on the calibration text our quantize reads by default, as many tokens as it uses."""
    exe = a.llama_imatrix or os.environ.get("LLAMA_IMATRIX") or shutil.which("llama-imatrix")
    if not exe:
        raise Fail("no llama-imatrix: build llama.cpp's tools (tools/requirements-llama.txt) and pass --llama-imatrix")
    docs = []
    for f in a.imatrix_text:
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                docs.append(json.loads(line)["text"] if f.suffix == ".jsonl" else line)
    text = out.with_suffix(".txt")
    text.write_text("\n\n".join(docs), encoding="utf-8")
    chunks = a.imatrix_tokens // a.imatrix_ctx
    cmd = [exe, "-m", str(gguf_path), "-f", str(text), "-o", str(out), "-c", str(a.imatrix_ctx),
           "--chunks", str(chunks), "-t", str(a.threads), "--no-ppl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        raise Fail(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-1500:]}")
    return dict(command=cmd, chunks=chunks, ctx=a.imatrix_ctx, files=[str(f) for f in a.imatrix_text])


def llama_study(a, binary: str) -> int:
    try:
        import llama_cpp
    except ImportError:
        raise Fail("llama_cpp is missing: pip install -r tools/requirements-llama.txt (builds llama.cpp)")
    import llama_cpp._logger
    llama_cpp._logger.set_verbose(False)  # llama.cpp's per-tensor quantize log; the types are summarised below
    llama_cpp.llama_backend_init()
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    stem = a.model.resolve().name
    ggufs = {}
    for t in ("bf16", "f16", "f32"):
        ggufs[t] = work / f"{stem}-{t}.gguf"
        if a.rebuild or not ggufs[t].exists():
            r = subprocess.run([sys.executable, str(ROOT / "tools/gguf_from_hf.py"), str(a.model), str(ggufs[t]),
                                "--outtype", t], capture_output=True, text=True)
            if r.returncode != 0:
                raise Fail(f"gguf_from_hf.py --outtype {t} failed: {r.stderr.strip()}")
    quants = [("q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, False), ("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, False),
              ("q4_k_m", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, False)]
    imatrix_info = None
    if not a.no_imatrix:
        imat = work / f"{stem}-imatrix.gguf"
        imatrix_info = make_imatrix(a, ggufs["bf16"], imat)
        quants += [("q4_0-imat", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True),
                   ("q4_k_m-imat", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, True)]
    for t, ft, with_imatrix in quants:
        ggufs[t] = work / f"{stem}-{t}.gguf"
        if a.rebuild or with_imatrix or not ggufs[t].exists():
            quantize(ggufs["bf16"], ggufs[t], ft, a.threads, imat if with_imatrix else None)
    kinds = ["f32", "f16"] + [q[0] for q in quants]
    # Our GGUF files (spark-tool quantize --format gguf-*) run through the same llama.cpp engine.
    for p in a.ours_gguf:
        key = f"ours:{p.name}"
        ggufs[key] = p
        kinds.append(key)
    bpw = {t: gguf_bpw(p) for t, p in ggufs.items()}
    type_checks = []
    for t in kinds:
        if not t.startswith("ours:"):
            continue
        ft = gguf_file_type(ggufs[t])
        peer = {2: "q4_0", 7: "q8_0", 15: "q4_k_m"}.get(ft)
        if peer in bpw:
            ours_types, peer_types = gguf_types(ggufs[t]), gguf_types(ggufs[peer])
            diff = sorted(n for n in set(ours_types) | set(peer_types) if ours_types.get(n) != peer_types.get(n))
            type_checks.append(dict(ours=t, llama=peer, identical=not diff,
                                    differing=[(n, ours_types.get(n), peer_types.get(n)) for n in diff[:20]]))

    ref = SparkTool(binary, a.model, [], "ours-f32")
    plan = make_plan(a, ref)
    stop = stop_ids(a.model)
    longest = max([len(i) for _, i in plan.prompts] + [len(w) for w in plan.windows]) + a.max_new_tokens
    n_ctx = a.n_ctx or 256 * math.ceil(longest / 256)
    eng = {t: LlamaCpp(ggufs[t], n_ctx, a.threads, a.flash_attn == "on", f"llama.cpp {t.upper()}",
                       a.extra_bufts == "on") for t in kinds}
    results = []
    pairs = [(ref, t) for t in kinds] + [(eng["f16"], t) for t in kinds[2:]]
    for r, t in pairs:
        t0 = time.time()
        res = compare(r, eng[t], plan, a.max_new_tokens, stop)
        res["candidate_file"], res["candidate_bpw"] = str(ggufs[t]), bpw[t]
        results.append(res)
        print(f"{eng[t].name} vs {r.name}: {time.time() - t0:.1f} s", file=sys.stderr)
    ours = []
    for ck in a.ours:
        for numerics in a.ours_numerics.split(","):
            j = parity_json(a, binary, ck, numerics, work / f"parity-{ck.name}-{numerics}.json")
            j["bpw"] = gptq_bpw(ck)
            j["numerics"] = numerics
            ours.append(j)

    # The same quantized files through spark-tool's own GGUF engine (llama.cpp's activation numerics):
    # its figures should predict llama.cpp's (docs/GGUF.md §6).
    predicted = {}
    if not a.no_spark_gguf:
        for t in kinds[2:]:
            predicted[t] = parity_json(a, binary, ggufs[t], "auto", work / f"parity-gguf-{Path(ggufs[t]).stem}.json")

    labels = {t: ("ours " + t[5:] + " in llama.cpp") if t.startswith("ours:")
              else "llama.cpp " + t.upper().replace("-IMAT", " + imatrix") for t in kinds}
    lines = [HEADER]
    for j in ours:
        lines.append(row(f"ours {Path(j['candidate']).name} {j['numerics'].upper()}", "ours f32", j["bpw"], j["overall"]))
    for res, (r, t) in zip(results, pairs):
        lines.append(row(labels[t], "ours f32" if r is ref else "llama.cpp F16", bpw[t], res["overall"]))
    for t, j in predicted.items():
        lines.append(row(labels[t].replace(" in llama.cpp", "") + " in spark-tool", "ours f32", bpw[t], j["overall"]))
    table = "\n".join(lines)
    print(table)
    if predicted:
        print("\nspark-tool's GGUF engine vs llama.cpp on the same file (KL mean, vs ours f32):")
        for (r, t), res in zip(pairs, results):
            if r is ref and t in predicted:
                ll, st = res["overall"]["kl_mean"], predicted[t]["overall"]["kl_mean"]
                print(f"  {labels[t]}: llama.cpp {ll:.3e}, spark-tool {st:.3e}, ratio {st / ll:.3f}")
    print("\ntensor types:")
    for t in kinds[2:]:
        print(f"  {t}: {bpw[t]['tensor_types']}; {bpw[t]['types_by_tensor']}")
    for c in type_checks:
        verdict = "identical" if c["identical"] else f"DIFFERENT: {c['differing']}"
        print(f"tensor types of {c['ours'][5:]} vs llama.cpp {c['llama'].upper()}: {verdict}")
    if imatrix_info:
        print(f"imatrix: {' '.join(imatrix_info['command'])}")
    print(f"reference perplexity {results[0]['overall']['ppl_reference']:.4f}; n_ctx {n_ctx}; threads {a.threads}; "
          f"flash attention {a.flash_attn}; llama-cpp-python {llama_cpp.__version__}")
    if a.json:
        a.json.write_text(json.dumps(dict(
            llama_cpp_python=llama_cpp.__version__, system_info=llama_cpp.llama_print_system_info().decode(),
            n_ctx=n_ctx, threads=a.threads, flash_attn=a.flash_attn, extra_bufts=a.extra_bufts, files={t: str(p) for t, p in ggufs.items()},
            imatrix=imatrix_info, type_checks=type_checks,
            bpw=bpw, results=results, ours=ours, spark_tool_gguf=predicted, table=table), indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "fixtures/spark-tiny", help="the original checkpoint")
    ap.add_argument("--spark-tool", help="spark-tool binary (default: $SPARK_TOOL, target/release/spark-tool, PATH)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llamacpp-fidelity",
                    help="where the GGUFs and parity JSONs go (reused when present)")
    ap.add_argument("--rebuild", action="store_true", help="rewrite the GGUFs even if present")
    ap.add_argument("--json", type=Path, help="write every figure (per prompt too) to this file")
    ap.add_argument("--ours", type=Path, action="append", default=[],
                    help="also list this spark-tool quantized checkpoint (spark-tool parity; repeatable)")
    ap.add_argument("--ours-gguf", type=Path, action="append", default=[],
                    help="our GGUF file (spark-tool quantize --format gguf-*), run in llama.cpp like its own quants; "
                         "its tensor types are compared with llama.cpp's file of the same type (repeatable)")
    ap.add_argument("--ours-numerics", default="w4a8,w4a16", help="numerics for --ours rows (comma list)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on")
    ap.add_argument("--no-spark-gguf", action="store_true",
                    help="skip running the quantized GGUF files through spark-tool parity as well")
    ap.add_argument("--extra-bufts", choices=["on", "off"], default="off",
                    help="llama.cpp's weight repacking (off: it faults on AMX machines in this build)")
    ap.add_argument("--n-ctx", type=int, default=0, help="llama.cpp context (default: longest sequence)")
    ap.add_argument("--prompts", type=Path, help="as spark-tool parity (default calibration/parity_prompts.json)")
    ap.add_argument("--eval-text", type=Path, help="as spark-tool parity (default calibration/heldout.jsonl)")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-imatrix", action="store_true", help="skip the Q4_0 / Q4_K_M rows made with an imatrix")
    ap.add_argument("--llama-imatrix", help="llama-imatrix binary (default: $LLAMA_IMATRIX, PATH)")
    ap.add_argument("--imatrix-text", type=Path, nargs="+", default=[ROOT / "calibration/spark-calib.jsonl"],
                    help="calibration text for llama-imatrix (.jsonl with {\"text\"} or plain text; default: "
                         "quantize's default set)")
    ap.add_argument("--imatrix-tokens", type=int, default=128 * 512, help="as quantize's default --samples x --seq-len")
    ap.add_argument("--imatrix-ctx", type=int, default=512)
    ap.add_argument("--self-check", type=Path, metavar="CKPT",
                    help="compare the numpy metrics with `spark-tool parity --model CKPT` and exit")
    ap.add_argument("--w4-numerics", choices=["auto", "w4a8", "w4a16"], default="auto", help="for --self-check")
    a = ap.parse_args()
    try:
        binary = find_spark_tool(a.spark_tool)
        for d in [a.model] + ([a.self_check] if a.self_check else []) + a.ours:
            if not (d / "config.json").exists():
                raise Fail(f"{d}: no config.json (not a checkpoint folder)")
        return self_check(a, binary) if a.self_check else llama_study(a, binary)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
