#!/usr/bin/env python3
"""spark-tool vs llama.cpp on a full-shape Spark-X2.5-1.7B, side by side, in one invocation.

    python3 tools/bench_vs_llamacpp.py                       # defaults: threads 1,2; pp512 tg128; 3 repeats
    python3 tools/bench_vs_llamacpp.py --cache /data/bvl --threads 2 --repeat 5 --quantize-head

Steps (every artifact is cached under --cache and reused on the next run):
 1. a random-weight Spark-1.7B checkpoint at the real shapes (tools/make_random_checkpoint.py 1.7b
    --tokenizer-from fixtures/spark-tiny), or --checkpoint DIR;
 2. our W4A8 g128 and W4A16 g64 artifacts with `spark-tool quantize --set method=rtn` (+ W4A8 with a 4-bit head
    with --quantize-head). RTN still runs a short calibration forward (the quantizer records per-layer
    errors), so it is given a few small windows (--calib-samples x --calib-seq-len);
 3. the same weights as GGUF (tools/gguf_from_hf.py, BF16), quantized to Q4_K_M and Q8_0 with llama-quantize
    (the BF16 intermediate is deleted unless --keep-gguf-src);
 4. llama-bench / llama-quantize: $LLAMA_BENCH (and $LLAMA_QUANTIZE, default: next to llama-bench), else
    /work/llama-src/build-bench/bin, else built in --cache from the PyPI sdist llama-cpp-python==0.3.36
    (Ninja, Release, GGML_NATIVE=ON, OpenMP, static, AMX GCC-12 barrier fix; docs/BENCHMARKS.md
    "Side by side with llama.cpp");
 5. memory bandwidth (streaming read of a 2 GiB array, numpy in a child process, N threads) per thread count, then both
    engines at the same thread counts, prompt and generation lengths, interleaved ours/theirs;
 6. one table (stdout + --markdown) and the raw results (--json).

Random weights: speed does not depend on the weight values (same shapes, same tensor types, same kernels),
so these numbers stand for the real model. Needs numpy and gguf (tools/requirements-llama.txt).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_PYPI = "llama-cpp-python==0.3.36"
LLAMA_SDIST_DIR = "llama_cpp_python-0.3.36"
DEFAULT_LLAMA_BIN = Path("/work/llama-src/build-bench/bin")

# (key, label, spark-tool quantize flags)
OURS = {
    "w4a8": ("W4A8 g128 (bf16 head)", ["--format", "w4a8", "--group-size", "128"]),
    "w4a16": ("W4A16 g64 (bf16 head)", ["--format", "w4a16", "--group-size", "64"]),
    "w4a8-qhead": ("W4A8 g128 (4-bit head)", ["--format", "w4a8", "--group-size", "128", "--quantize-head"]),
    "w4a16-qhead": ("W4A16 g64 (4-bit head)", ["--format", "w4a16", "--group-size", "64", "--quantize-head"]),
}
THEIRS = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}
# (ours, theirs) pairs whose ratios are printed.
RATIO_PAIRS = [("w4a8", "q4_k_m"), ("w4a16", "q4_k_m"), ("w4a8-qhead", "q4_k_m"), ("w4a16-qhead", "q4_k_m"),
               ("w4a8", "q8_0"), ("w4a16", "q8_0"), ("w4a8-qhead", "q8_0"), ("w4a16-qhead", "q8_0")]
# What `spark-tool run` answers when timing process start → first token.
FIRST_TOKEN_PROMPT = "What is the capital of France?"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ------------------------------------------------------------------ bytes of weights read per decoded token

def safetensors_tensors(folder: Path) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype, shape, nbytes) over every *.safetensors file of a checkpoint folder (headers only)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        for name, t in head.items():
            if name == "__metadata__":
                continue
            b, e = t["data_offsets"]
            out[name] = (t["dtype"], t["shape"], e - b)
    return out


def bytes_per_token_ours(folder: Path) -> dict:
    """Every tensor an ideal decode step reads once: quantized linears (qweight + qzeros + scales), the
    unquantized g_proj and norms, and the head. Not counted: the token-embedding table when the head is a
    separate tensor (a lookup reads one row), g_idx (k/G for these non-act-order checkpoints; kernels use the
    group arithmetically), and the KV cache (context-dependent, see the notes)."""
    ts = safetensors_tensors(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", False)) and not any(n.startswith("lm_head.") for n in ts)
    total, parts = 0, {"linears_q4": 0, "scales_zeros": 0, "other_layers": 0, "head": 0, "excluded": 0}
    for name, (_dt_, _shape, nb) in ts.items():
        if name.endswith(".g_idx"):
            parts["excluded"] += nb
            continue
        if name in ("model.embedding.weight", "model.embed_tokens.weight"):
            if tied:
                parts["head"] += nb
                total += nb
            else:
                parts["excluded"] += nb
            continue
        if name.startswith("lm_head."):
            parts["head"] += nb
        elif name.endswith(".qweight"):
            parts["linears_q4"] += nb
        elif name.endswith((".scales", ".qzeros")):
            parts["scales_zeros"] += nb
        else:
            parts["other_layers"] += nb
        total += nb
    return {"bytes": total, "tied_head": tied, **parts}


def bytes_per_token_gguf(path: Path) -> dict:
    """GGUF tensor data sizes; token_embd.weight is excluded when output.weight exists (separate head) and
    counted as the head when it does not (tied: llama.cpp multiplies by token_embd)."""
    import gguf  # noqa: PLC0415

    r = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    types: dict[str, int] = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    tied = "output.weight" not in sizes
    total = sum(sizes.values())
    excluded = 0 if tied else sizes.get("token_embd.weight", 0)
    head = sizes.get("token_embd.weight", 0) if tied else sizes["output.weight"]
    return {"bytes": total - excluded, "tied_head": tied, "head": head, "excluded": excluded,
            "tensor_data": total, "bytes_by_type": types, "file_bytes": path.stat().st_size}


# ------------------------------------------------------------------ memory bandwidth

def measure_bandwidth(threads: int, gib: float = 2.0, passes: int = 8) -> dict:
    """Streaming read: numpy sum over a `gib` GiB float64 array split in `threads` contiguous parts, one Python
    thread each (ufunc reductions release the GIL). One warm-up pass (page faults), then `passes` timed
    passes. wall = bytes / wall time; oncpu = bytes / max per-thread CPU time (robust to descheduling)."""
    import numpy as np  # noqa: PLC0415

    a = np.ones(int(gib * (1 << 30)) // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    wall, oncpu = [], []
    for i in range(passes + 1):
        cpu = [0.0] * threads

        def work(j: int) -> None:
            c = time.thread_time()
            np.add.reduce(parts[j])
            cpu[j] = time.thread_time() - c

        ths = [threading.Thread(target=work, args=(j,)) for j in range(threads)]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t
        if i:
            wall.append(a.nbytes / dt / 1e9)
            oncpu.append(a.nbytes / max(cpu) / 1e9)
    del parts, a
    return {"threads": threads, "array_bytes": int(gib * (1 << 30)), "passes": passes,
            "wall_gbs": spread(wall), "oncpu_gbs": spread(oncpu), "method": "numpy add.reduce, float64"}


# ------------------------------------------------------------------ helpers

def spread(v: list) -> dict:
    v = [x for x in v if x is not None]
    if not v:
        return {"min": None, "median": None, "max": None, "n": 0, "samples": []}
    return {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v), "samples": list(v)}


# Runs the benchmark as its child and reports that child's ru_maxrss. Needed because Linux carries the RSS of the
# forking process into the child's ru_maxrss (exec records the old mm's high-water mark): forking straight from
# this script would add its own RSS; this helper is a fresh, small interpreter (~10 MB).
_RSS_HELPER = r"""
import os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, st, ru = os.wait4(p.pid, 0)
open(sys.argv[1], "w").write(str(ru.ru_maxrss))
c = os.waitstatus_to_exitcode(st)
sys.exit(c if c >= 0 else 128 - c)
"""


def run_measured(cmd: list, stdout_path: Path, stderr_path: Path, timeout: float | None = None) -> dict:
    """Run one benchmark process; peak RSS of exactly that process (wait4 ru_maxrss, KiB on Linux)."""
    log("$ " + " ".join(str(c) for c in cmd))
    rss_file = stdout_path.with_suffix(".maxrss")
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        t = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", _RSS_HELPER, str(rss_file), *[str(c) for c in cmd]],
                             stdout=out, stderr=err, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            raise RuntimeError(f"{cmd[0]} ran past --cell-timeout {timeout} s (see {stderr_path})") from None
        wall = time.perf_counter() - t
    if p.returncode != 0:
        tail = stderr_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{cmd[0]} exited {p.returncode} (see {stderr_path}):\n{tail}")
    return {"peak_rss_bytes": int(rss_file.read_text()) * 1024, "wall_s": wall}


def measure_bandwidth_subprocess(threads: int, gib: float) -> dict:
    """measure_bandwidth in a child interpreter, so this process never holds the 2 GiB array."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"import bench_vs_llamacpp as b; print(json.dumps(b.measure_bandwidth({threads}, {gib})))")
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def first_json(text: str):
    """The JSON value printed on stdout (llama-bench may print nothing else; be lenient anyway)."""
    text = text.strip()
    start = min([i for i in (text.find("["), text.find("{")) if i >= 0], default=-1)
    if start < 0:
        raise ValueError("no JSON on stdout")
    return json.JSONDecoder().raw_decode(text[start:])[0]


# ------------------------------------------------------------------ step 1-3: artifacts

def ensure_checkpoint(a, py: str) -> Path:
    if a.checkpoint:
        ck = a.checkpoint
        if not (ck / "config.json").exists():
            sys.exit(f"error: --checkpoint {ck} has no config.json")
        return ck
    ck = a.cache / "spark-1.7b-random"
    if (ck / "config.json").exists():
        log(f"reusing checkpoint {ck}")
        return ck
    tmp = a.cache / "spark-1.7b-random.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    run([py, REPO / "tools/make_random_checkpoint.py", "1.7b", tmp, "--tokenizer-from", REPO / "fixtures/spark-tiny"])
    tmp.rename(ck)
    return ck


def ensure_ours(a, spark: Path, ck: Path, key: str) -> Path:
    label, flags = OURS[key]
    out = a.cache / f"{key}-rtn"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")) and not a.force_artifacts:
        log(f"reusing {label}: {out}")
        return out
    tmp = a.cache / f"{key}-rtn.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    qlog = a.logdir / f"quantize-{key}.log"
    log(f"quantizing {label} (RTN; a few minutes, ~14 GB RAM for 1.7B); report in {qlog}")
    with open(qlog, "wb") as fh:
        run([spark, "quantize", ck, "--out", tmp, *flags, "--set", "method=rtn", "--no-compare", "--quiet",
             "--samples", str(a.calib_samples), "--seq-len", str(a.calib_seq_len)], stdout=fh)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def ensure_gguf(a, py: str, ck: Path, quantize_bin: Path, keys: list[str]) -> dict[str, Path]:
    outs = {k: a.cache / f"spark-1.7b-random-{k}.gguf" for k in keys}
    missing = [k for k, p in outs.items() if not p.exists() or a.force_artifacts]
    if not missing:
        for k, p in outs.items():
            log(f"reusing {THEIRS[k]}: {p}")
        return outs
    src = a.cache / "spark-1.7b-random-bf16.gguf"
    if not src.exists():
        tmp = src.with_suffix(".partial")
        run([py, REPO / "tools/gguf_from_hf.py", ck, tmp, "--outtype", "bf16",
             "--tokenizer", ck if (ck / "tokenizer.json").exists() else REPO / "fixtures/spark-tiny",
             "--name", "spark-1.7b-random"], stdout=sys.stderr)
        tmp.rename(src)
    for k in missing:
        tmp = outs[k].with_suffix(".partial")
        qlog = a.logdir / f"llama-quantize-{k}.log"
        log(f"llama-quantize {THEIRS[k]}; log in {qlog}")
        with open(qlog, "wb") as fh:
            run([quantize_bin, src, tmp, THEIRS[k], str(max(os.cpu_count() or 1, 1))], stdout=fh,
                stderr=subprocess.STDOUT)
        tmp.rename(outs[k])
    if not a.keep_gguf_src:
        src.unlink()
        log(f"deleted the BF16 intermediate {src}")
    return outs


# ------------------------------------------------------------------ step 4: llama.cpp tools

def find_cmake(py: str) -> tuple[str, str | None]:
    cmake = shutil.which("cmake") or str(Path(py).parent / "cmake")
    if not Path(cmake).exists() and not shutil.which("cmake"):
        sys.exit("error: cmake not found; `python3 -m pip install cmake ninja` (PyPI) or install it from the OS")
    ninja = shutil.which("ninja") or (str(Path(py).parent / "ninja") if (Path(py).parent / "ninja").exists() else None)
    return cmake, ninja


def apply_amx_fix(tree: Path) -> None:
    """GCC 12 drops the stores filling the AMX tile config (docs/BENCHMARKS.md "Side by side with
    llama.cpp"): add a compiler barrier before _tile_loadconfig. Idempotent; harmless on CPUs without AMX."""
    f = tree / "ggml/src/ggml-cpu/amx/mmq.cpp"
    if not f.exists():
        return
    s = f.read_text()
    barrier = '__asm__ __volatile__("" : : "r"(&tc) : "memory");'
    if barrier in s:
        return
    s2 = s.replace("    _tile_loadconfig(&tc);", f"    {barrier}\n    _tile_loadconfig(&tc);", 1)
    if s2 != s:
        f.write_text(s2)
        log("applied the AMX tile-config barrier fix")


def build_llama(a, py: str) -> Path:
    root = a.cache / "llama.cpp"
    bindir = root / "build/bin"
    if (bindir / "llama-bench").exists() and (bindir / "llama-quantize").exists():
        return bindir
    sdist_dir = root / "sdist"
    sdist = sdist_dir / f"{LLAMA_SDIST_DIR}.tar.gz"
    if not sdist.exists():
        # --no-binary for this one package only (`:all:` would source-build pip's build deps too).
        run([py, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", sdist_dir, LLAMA_PYPI])
    tree = root / LLAMA_SDIST_DIR / "vendor/llama.cpp"
    if not tree.exists():
        run(["tar", "xzf", sdist, "-C", root])
    if not (tree / "src/models/spark2-5.cpp").exists():
        sys.exit(f"error: {tree} has no spark2_5 support (src/models/spark2-5.cpp)")
    apply_amx_fix(tree)
    cmake, ninja = find_cmake(py)
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    if not ninja:
        log("ninja not found: using the default CMake generator")
    run([cmake, "-S", tree, "-B", root / "build", *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"])
    run([cmake, "--build", root / "build", "-j", str(os.cpu_count() or 2), "--target", "llama-bench", "llama-quantize"])
    return bindir


def locate_llama(a, py: str) -> tuple[Path, Path]:
    bench = os.environ.get("LLAMA_BENCH") or (a.llama_bench and str(a.llama_bench))
    if bench:
        bench = Path(bench)
    elif (DEFAULT_LLAMA_BIN / "llama-bench").exists():
        bench = DEFAULT_LLAMA_BIN / "llama-bench"
    else:
        bench = build_llama(a, py) / "llama-bench"
    quant = Path(os.environ.get("LLAMA_QUANTIZE") or bench.parent / "llama-quantize")
    for p in (bench, quant):
        if not os.access(p, os.X_OK):
            sys.exit(f"error: {p} is not an executable (set LLAMA_BENCH / LLAMA_QUANTIZE)")
    return bench, quant


def locate_spark(a) -> Path:
    if a.spark_tool:
        return a.spark_tool
    run(["cargo", "build", "--release"], cwd=REPO)
    return REPO / "target/release/spark-tool"


# ------------------------------------------------------------------ step 5: the benchmark

def bench_ours(a, spark: Path, art: Path, threads: int, reps: int, tag: str) -> dict:
    stem = a.logdir / tag
    m = run_measured([spark, "bench", art, "--prompt-len", a.prompt_len, "--gen", a.gen, "--threads", threads,
                      "--repeat", reps, "--json"], stem.with_suffix(".json"), stem.with_suffix(".err"),
                     a.cell_timeout)
    j = first_json(stem.with_suffix(".json").read_text())
    return {"prefill": _expand(j["prefill_tok_s"], reps),
            "decode": _expand(j["decode_tok_s"], reps), "ttft_ms": _expand(j["time_to_first_token_ms"], reps),
            "peak_rss_bytes": m["peak_rss_bytes"], "self_peak_rss_bytes": j.get("peak_rss_bytes"),
            "load_ms": j.get("load_ms"), "threads_reported": j.get("threads"), "raw": j}


def _expand(s: dict, reps: int) -> list:
    """spark-tool bench reports min/median/max, not every sample. With one repeat per call (the default
    interleaving) that is the sample; with --interleave cells the spread is kept as min, median, max."""
    if reps == 1:
        return [s["median"]]
    return [s["min"], s["median"], s["max"]]


def bench_theirs(a, bench: Path, gguf_path: Path, threads: int, reps: int, tag: str) -> dict:
    stem = a.logdir / tag
    m = run_measured([bench, "-m", gguf_path, "-p", a.prompt_len, "-n", a.gen, "-t", threads, "-r", reps,
                      "-o", "json"], stem.with_suffix(".json"), stem.with_suffix(".err"), a.cell_timeout)
    rows = first_json(stem.with_suffix(".json").read_text())
    pp = [r for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    tg = [r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    return {"prefill": [x for r in pp for x in r.get("samples_ts", [r["avg_ts"]])],
            "decode": [x for r in tg for x in r.get("samples_ts", [r["avg_ts"]])], "ttft_ms": [],
            "peak_rss_bytes": m["peak_rss_bytes"],
            "build": {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                  "n_batch", "n_ubatch", "flash_attn", "type_k", "type_v")}
            if rows else {}}


# ------------------------------------------------------------------ step 6: the table

def fmt_spread(s: dict, digits: int = 1) -> str:
    if not s or s["median"] is None:
        return "–"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def render(res: dict) -> str:
    p, g = res["config"]["prompt_len"], res["config"]["gen"]
    L = []
    L.append(f"Spark-X2.5-1.7B, full shape, random weights (speed does not depend on the weight values). "
             f"Prefill pp{p}, decode tg{g}; {res['config']['repeat']} repeat(s) per cell, interleaved "
             f"({res['config']['interleave']}). {res['machine']['cpu']}, {res['machine']['cores']} cores. "
             f"Load average at start {res['load_start']}, at end {res['load_end']}.")
    L.append("")
    bw = res["bandwidth"]
    gib = next((b["array_bytes"] / 2**30 for b in bw.values() if b.get("array_bytes")), None)
    L.append(f"Memory bandwidth (streaming read{f' of {gib:g} GiB' if gib else ''}, numpy add.reduce): " + "; ".join(
        f"{t} thread{'s' if int(t) > 1 else ''}: {b['used_gbs']:.1f} GB/s {b.get('used_stat', '')}"
        f" (wall {fmt_spread(b['wall_gbs'])}, on-CPU {fmt_spread(b['oncpu_gbs'])})"
        + (" [given]" if b.get("given") else "") for t, b in bw.items()))
    L.append("")
    L.append("| engine / format | threads | prefill tok/s median (min–max) | decode tok/s median (min–max) "
             "| TTFT ms | peak RSS GiB | weight bytes / token | decode ceiling tok/s | % of ceiling |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for c in res["cells"]:
        bpt = res["artifacts"][c["format"]]["bytes_per_token"]["bytes"]
        L.append(f"| {c['engine']} {c['label']} | {c['threads']} | {fmt_spread(c['prefill_tok_s'])} | "
                 f"{fmt_spread(c['decode_tok_s'], 2)} | {fmt_spread(c['ttft_ms'], 0)} | "
                 f"{c['peak_rss_bytes'] / 2**30:.2f} | {bpt / 1e9:.3f} GB | {c['ceiling_tok_s']:.1f} | "
                 f"{c['pct_of_ceiling']:.0f} % |")
    if res["ratios"]:
        L.append("")
        L.append("| ours / llama.cpp (medians) | threads | decode | prefill |")
        L.append("|---|---|---|---|")
        for r in res["ratios"]:
            L.append(f"| {r['ours']} / {r['theirs']} | {r['threads']} | {r['decode']:.2f}× | {r['prefill']:.2f}× |")
    ft = res.get("first_token")
    if ft:
        L.append("")
        L.append(f"Process start → first token (warm page cache, `spark-tool run ARTIFACT --chat --prompt "
                 f"\"{ft['prompt']}\" --max-new-tokens 1 --threads {ft['threads']}`, timed from outside; loads, "
                 "repacks, tokenizes, prefills the chat frame and samples one token):")
        L.append("")
        L.append("| artifact | ms median (min–max) |")
        L.append("|---|---|")
        for label, v in ft["ms"].items():
            L.append(f"| spark-tool {label} | {fmt_spread(v, 0)} |")
    L.append("")
    L.append("Bytes/token: weights read once per decoded token — ours: qweight + qzeros + scales of every "
             "quantized linear, the bf16 g_proj and norms, and the head (the bf16 embedding when tied); GGUF: all "
             "tensor data. The token-embedding table is left out when the head is a separate tensor (a lookup "
             "reads one row); KV-cache reads are not counted. Ceiling = bandwidth at that thread count ÷ "
             "bytes/token. llama-bench times tg on an empty context, ours decodes after the prompt.")
    return "\n".join(L)


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "spark-bench-vs-llamacpp",
                    help="artifact cache (checkpoint, our artifacts, GGUFs, llama.cpp build); reused when present")
    ap.add_argument("--checkpoint", type=Path, help="use this full-shape HF checkpoint instead of making one")
    ap.add_argument("--spark-tool", type=Path, help="spark-tool binary (default: cargo build --release, then "
                    "target/release/spark-tool)")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench binary (default: $LLAMA_BENCH, then "
                    f"{DEFAULT_LLAMA_BIN}, then a build from the PyPI sdist in --cache)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interleave", choices=["rounds", "cells"], default="rounds",
                    help="rounds (default): REPEAT rounds, each running every cell once (1 repeat per process, "
                    "ours and theirs alternating, order reversed every other round); cells: each cell runs once "
                    "with all repeats in one process (llama-bench -r REPEAT)")
    ap.add_argument("--quantize-head", action="store_true",
                    help="also bench W4A8 g128 and W4A16 g64 with a 4-bit head")
    ap.add_argument("--no-q8", action="store_true", help="skip Q8_0")
    ap.add_argument("--bandwidth", help="skip the measurement and use these GB/s, e.g. 1=13.2,2=26.5")
    ap.add_argument("--bw-stat", choices=["wall", "oncpu"], default="wall",
                    help="which bandwidth median sets the ceiling: wall (default) or on-CPU (bytes / per-thread "
                    "CPU time, closer to the hardware figure when other tenants deschedule us)")
    ap.add_argument("--bw-gib", type=float, default=2.0, help="bandwidth array size (default 2 GiB)")
    ap.add_argument("--calib-samples", type=int, default=2, help="calibration windows for the RTN quantize")
    ap.add_argument("--calib-seq-len", type=int, default=64)
    ap.add_argument("--force-artifacts", action="store_true", help="rebuild our artifacts and the GGUFs")
    ap.add_argument("--keep-gguf-src", action="store_true", help="keep the BF16 GGUF intermediate")
    ap.add_argument("--cell-timeout", type=float, default=None, help="seconds per benchmark process")
    ap.add_argument("--json", type=Path, help="results JSON (default: CACHE/results/bench-TIME.json)")
    ap.add_argument("--markdown", type=Path, help="table markdown (default: next to the JSON)")
    a = ap.parse_args()

    threads = [int(t) for t in a.threads.split(",") if t.strip()]
    py = sys.executable
    a.cache = a.cache.resolve()
    a.cache.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.logdir = a.cache / "logs" / stamp
    a.logdir.mkdir(parents=True, exist_ok=True)
    a.json = a.json or a.cache / "results" / f"bench-{stamp}.json"
    a.markdown = a.markdown or a.json.with_suffix(".md")
    if shutil.disk_usage(a.cache).free < 12e9:
        log(f"warning: only {shutil.disk_usage(a.cache).free / 1e9:.1f} GB free under {a.cache}; "
            "a cold run needs ~12 GB (checkpoint 3.4, BF16 GGUF 3.4 transient, ours ~1.3 each, GGUFs 2.9)")

    spark = locate_spark(a)
    bench, quant = locate_llama(a, py)
    log(f"spark-tool: {spark}; llama-bench: {bench}; llama-quantize: {quant}")
    ck = ensure_checkpoint(a, py)
    ours_keys = ["w4a8", "w4a16"] + (["w4a8-qhead", "w4a16-qhead"] if a.quantize_head else [])
    theirs_keys = ["q4_k_m"] + ([] if a.no_q8 else ["q8_0"])
    ours = {k: ensure_ours(a, spark, ck, k) for k in ours_keys}
    theirs = ensure_gguf(a, py, ck, quant, theirs_keys)

    artifacts = {}
    for k, p in ours.items():
        artifacts[k] = {"engine": "spark-tool", "label": OURS[k][0], "path": str(p),
                        "bytes_per_token": bytes_per_token_ours(p)}
    for k, p in theirs.items():
        artifacts[k] = {"engine": "llama.cpp", "label": THEIRS[k], "path": str(p),
                        "bytes_per_token": bytes_per_token_gguf(p)}

    load_start = load_average()
    bw = {}
    given = dict(kv.split("=") for kv in a.bandwidth.split(",")) if a.bandwidth else {}
    for t in threads:
        if str(t) in given:
            bw[str(t)] = {"used_gbs": float(given[str(t)]), "given": True,
                          "wall_gbs": None, "oncpu_gbs": None}
            continue
        log(f"bandwidth, {t} thread(s)")
        m = measure_bandwidth_subprocess(t, a.bw_gib)
        m["used_gbs"] = m[f"{a.bw_stat}_gbs"]["median"]
        m["used_stat"] = a.bw_stat
        bw[str(t)] = m

    # Pair ours with theirs so each round alternates engines: ours, theirs, ours, theirs, ...
    order = []
    for i in range(max(len(ours_keys), len(theirs_keys))):
        if i < len(ours_keys):
            order.append(ours_keys[i])
        if i < len(theirs_keys):
            order.append(theirs_keys[i])
    samples = {(k, t): {"prefill": [], "decode": [], "ttft_ms": [], "rss": [], "extra": []}
               for k in order for t in threads}
    round_loads = []
    rounds, reps = (a.repeat, 1) if a.interleave == "rounds" else (1, a.repeat)
    for r in range(rounds):
        seq = order if r % 2 == 0 else order[::-1]
        for t in threads:
            round_loads.append({"round": r + 1, "threads": t, "load": load_average()})
            log(f"round {r + 1}/{rounds}, {t} thread(s), load {round_loads[-1]['load']}")
            for k in seq:
                tag = f"r{r + 1}-t{t}-{k}"
                if k in ours:
                    out = bench_ours(a, spark, ours[k], t, reps, tag)
                else:
                    out = bench_theirs(a, bench, theirs[k], t, reps, tag)
                s = samples[(k, t)]
                s["prefill"] += out["prefill"]
                s["decode"] += out["decode"]
                s["ttft_ms"] += out["ttft_ms"]
                s["rss"].append(out["peak_rss_bytes"])
                s["extra"].append({kk: v for kk, v in out.items() if kk not in ("prefill", "decode", "ttft_ms")})
                log(f"  {k} t={t}: prefill {out['prefill']} decode {out['decode']} tok/s, "
                    f"peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB")

    # Process start → first token (warm page cache): `spark-tool run` with a short chat prompt and
    # one new token, timed from outside the process, at the largest thread count.
    first_token = {}
    for k in ours_keys:
        walls = []
        for i in range(max(a.repeat, 3)):
            t0 = time.perf_counter()
            subprocess.run([str(spark), "run", str(ours[k]), "--chat", "--prompt", FIRST_TOKEN_PROMPT,
                            "--max-new-tokens", "1", "--quiet", "--threads", str(max(threads))],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            walls.append(1000 * (time.perf_counter() - t0))
        first_token[k] = spread(walls)
        log(f"  {k}: process start to first token {first_token[k]['median']:.0f} ms")

    cells = []
    for k in order:
        for t in threads:
            s = samples[(k, t)]
            dec = spread(s["decode"])
            bpt = artifacts[k]["bytes_per_token"]["bytes"]
            ceil = bw[str(t)]["used_gbs"] * 1e9 / bpt
            cells.append({"format": k, "engine": artifacts[k]["engine"], "label": artifacts[k]["label"],
                          "threads": t, "prefill_tok_s": spread(s["prefill"]), "decode_tok_s": dec,
                          "ttft_ms": spread(s["ttft_ms"]), "peak_rss_bytes": max(s["rss"]),
                          "ceiling_tok_s": ceil, "pct_of_ceiling": 100 * dec["median"] / ceil,
                          "runs": s["extra"]})
    by = {(c["format"], c["threads"]): c for c in cells}
    ratios = []
    for o, th in RATIO_PAIRS:
        for t in threads:
            if (o, t) in by and (th, t) in by:
                co, ct = by[(o, t)], by[(th, t)]
                ratios.append({"ours": OURS[o][0], "theirs": THEIRS[th], "threads": t,
                               "decode": co["decode_tok_s"]["median"] / ct["decode_tok_s"]["median"],
                               "prefill": co["prefill_tok_s"]["median"] / ct["prefill_tok_s"]["median"]})
    cpu = "?"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        pass
    res = {
        "note": "random weights at the real shapes: speed does not depend on the weight values",
        "config": {"prompt_len": a.prompt_len, "gen": a.gen, "repeat": a.repeat, "threads": threads,
                   "interleave": a.interleave, "order": order, "llama_bench": str(bench), "spark_tool": str(spark),
                   "checkpoint": str(ck), "quantize_method": "rtn"},
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "amx": "amx_tile" in flags,
                    "avx512_vnni": "avx512_vnni" in flags, "avx512_bf16": "avx512_bf16" in flags,
                    "kernel": platform.release()},
        "started": stamp, "load_start": load_start, "load_end": load_average(),
        "round_loads": round_loads,
        "bandwidth": bw, "artifacts": artifacts, "cells": cells, "ratios": ratios, "logs": str(a.logdir),
        "first_token": {"prompt": FIRST_TOKEN_PROMPT, "threads": max(threads),
                        "ms": {OURS[k][0]: v for k, v in first_token.items()}},
    }
    table = render(res)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=2) + "\n")
    a.markdown.write_text(table + "\n")
    print(table)
    log(f"wrote {a.json} and {a.markdown}; raw outputs in {a.logdir}")


if __name__ == "__main__":
    main()
