#!/usr/bin/env python3
"""Our GGUF files against llama.cpp's own files of the same type, in llama.cpp itself: loads, runs, speed.

    python3 tools/gguf_speed.py CHECKPOINT OURS.gguf [OURS.gguf ...] --llama-bin DIR [--work DIR]

CHECKPOINT is the HF checkpoint OURS were quantized from (`spark-tool quantize CHECKPOINT --format gguf-...`).
For each of our files this
  1. makes llama.cpp's file of the same type from CHECKPOINT: tools/gguf_from_hf.py --outtype bf16 (the
     official BF16 -> quant pipeline), then `llama-quantize BF16 OUT TYPE` (no imatrix: speed does not depend
     on the values, only on the tensor types);
  2. checks that every tensor has the same ggml type in both files (gguf reader), so the same kernels run;
  3. runs `llama-bench -m FILE -p P -n N -t T -r 1 --repack R -o json` on both, interleaved (ours, theirs, theirs, ours, ...)
     for --repeat rounds, and prints median prefill / decode tok/s and ours/theirs ratios.
A file that llama.cpp cannot load makes llama-bench fail, and this script with it (exit 1).

Needs numpy and gguf (tools/requirements.txt) and a llama.cpp build with llama-bench and llama-quantize
(tools/bench_vs_llamacpp.py documents one, from the same pinned source as tools/llamacpp_fidelity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILE_TYPES = {2: "Q4_0", 7: "Q8_0", 15: "Q4_K_M"}  # general.file_type -> llama-quantize type name


class Fail(Exception):
    pass


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", **kw)
    if r.returncode != 0:
        raise Fail(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    return r


def gguf_info(path: Path) -> tuple[str, dict[str, str], int]:
    import gguf
    r = gguf.GGUFReader(str(path))
    f = r.fields.get("general.file_type")
    ft = int(f.contents()) if f is not None else None
    if ft not in FILE_TYPES:
        raise Fail(f"{path}: general.file_type {ft} is not one of {FILE_TYPES}")
    return FILE_TYPES[ft], {t.name: t.tensor_type.name for t in r.tensors}, sum(int(t.n_bytes) for t in r.tensors)


def bench(a, path: Path) -> tuple[float, float]:
    r = run([a.llama_bin / "llama-bench", "-m", path, "-p", a.prompt_len, "-n", a.gen, "-t", a.threads, "-r", 1,
             "--repack", a.repack, "-o", "json"])
    text = r.stdout
    rows = json.loads(text[text.index("["):text.rindex("]") + 1])
    pp = [x["avg_ts"] for x in rows if x["n_prompt"] > 0 and x["n_gen"] == 0]
    tg = [x["avg_ts"] for x in rows if x["n_gen"] > 0 and x["n_prompt"] == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise Fail(f"llama-bench on {path}: expected one pp and one tg row, got {rows}")
    return pp[0], tg[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("ours", type=Path, nargs="+")
    ap.add_argument("--llama-bin", type=Path, default=os.environ.get("LLAMA_BIN"), required="LLAMA_BIN" not in os.environ,
                    help="folder with llama-bench and llama-quantize (default: $LLAMA_BIN)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gguf-speed"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--repack", choices=["0", "1"], default="0",
                    help="llama-bench --repack (default 0: on an AMX machine the repacked AMX path of llama.cpp "
                         "0.3.36 dies with SIGILL at its first tile instruction, for llama.cpp's own files too)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    stem = a.checkpoint.resolve().name
    bf16 = a.work / f"{stem}-bf16.gguf"
    if not bf16.exists():
        run([sys.executable, ROOT / "tools/gguf_from_hf.py", a.checkpoint, bf16, "--outtype", "bf16"])
    pairs = []
    for ours in a.ours:
        ty, ours_types, ours_bytes = gguf_info(ours)
        theirs = a.work / f"{stem}-{ty.lower()}.gguf"
        if not theirs.exists():
            run([a.llama_bin / "llama-quantize", bf16, theirs, ty, a.threads])
        _, their_types, their_bytes = gguf_info(theirs)
        diff = sorted(n for n in set(ours_types) | set(their_types) if ours_types.get(n) != their_types.get(n))
        if diff:
            raise Fail(f"{ours} and llama.cpp's {ty} differ in tensor types: "
                       + ", ".join(f"{n}: {ours_types.get(n)} vs {their_types.get(n)}" for n in diff[:10]))
        pairs.append(dict(type=ty, ours=str(ours), theirs=str(theirs), tensor_bytes=[ours_bytes, their_bytes],
                          samples={"ours": [], "theirs": []}))
        print(f"{ty}: tensor types identical ({len(ours_types)} tensors); tensor bytes {ours_bytes} vs "
              f"{their_bytes}", file=sys.stderr)
    for r in range(a.repeat):
        for p in pairs:
            order = ["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]
            for who in order:
                pp, tg = bench(a, Path(p[who]))
                p["samples"][who].append([pp, tg])
                print(f"round {r + 1} {p['type']} {who}: pp{a.prompt_len} {pp:.1f} tok/s, tg{a.gen} {tg:.2f} tok/s",
                      file=sys.stderr)
    print(f"| type | file | pp{a.prompt_len} tok/s median (min–max) | tg{a.gen} tok/s median (min–max) |")
    print("|---|---|---|---|")
    for p in pairs:
        for who in ("ours", "theirs"):
            s = p["samples"][who]
            pp, tg = [x[0] for x in s], [x[1] for x in s]
            p[f"{who}_median"] = [statistics.median(pp), statistics.median(tg)]
            label = "ours (GPTQ)" if who == "ours" else "llama.cpp"
            print(f"| {p['type']} | {label} | {statistics.median(pp):.1f} ({min(pp):.1f}–{max(pp):.1f}) | "
                  f"{statistics.median(tg):.2f} ({min(tg):.2f}–{max(tg):.2f}) |")
    for p in pairs:
        o, t = p["ours_median"], p["theirs_median"]
        print(f"{p['type']} ours/llama.cpp: prefill {o[0] / t[0]:.3f}×, decode {o[1] / t[1]:.3f}×")
    print(f"threads {a.threads}, {a.repeat} round(s), llama-bench {a.llama_bin}")
    if a.json:
        a.json.write_text(json.dumps(dict(config=vars(a) | {"work": str(a.work), "llama_bin": str(a.llama_bin),
                                                            "checkpoint": str(a.checkpoint), "json": str(a.json),
                                                            "ours": [str(x) for x in a.ours]},
                                          pairs=pairs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
