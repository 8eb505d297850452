#!/usr/bin/env python3
"""Process start -> first token of `spark-tool run`, timed from outside, for one or more binaries.

One warm-up run per binary (the page cache), then REPEATS rounds with the binaries alternating, so that a
noisy host moves them alike. Prints the load average before and after, and per binary the wall time and
the load time `run --stats` reports: median (min-max). docs/BENCHMARKS.md "Time to first token".

    python3 tools/ttft.py ARTIFACT BIN_A[,BIN_B...] [--repeat 7] [-- extra run flags, e.g. --w4-numerics w4a16]
"""
import argparse
import statistics
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("binaries", help="comma-separated spark-tool binaries")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    bins = a.binaries.split(",")
    wall = {b: [] for b in bins}
    load = {b: [] for b in bins}
    print("load average at start:", " ".join(open("/proc/loadavg").read().split()[:3]))
    for i in range(a.repeat + 1):
        for b in bins:
            cmd = [b, "--threads", str(a.threads), "run", a.artifact, "--chat", "--prompt",
                   "What is the capital of France?", "--max-new-tokens", "1", "--stats", *extra]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            dt = (time.perf_counter() - t0) * 1000
            if p.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
            if i == 0:
                continue
            wall[b].append(dt)
            load[b] += [float(line.split()[1]) for line in (p.stdout + p.stderr).splitlines()
                        if line.startswith("load ")]
    print("load average at end:", " ".join(open("/proc/loadavg").read().split()[:3]))
    for b in bins:
        w, l = sorted(wall[b]), sorted(load[b])
        print(f"{b}: process start -> first token {statistics.median(w):.0f} ms ({w[0]:.0f}-{w[-1]:.0f}); "
              f"loading {statistics.median(l):.0f} ms ({l[0]:.0f}-{l[-1]:.0f}); {len(w)} runs")


if __name__ == "__main__":
    main()
