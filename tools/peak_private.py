#!/usr/bin/env python3
"""Run a command and report its wall time, CPU use and peak memory, private and total.

    python3 tools/peak_private.py [--json OUT] -- CMD ARGS...

The kernel keeps a high-water mark only for the whole resident set (VmHWM, what `/usr/bin/time -v`
prints as "Maximum resident set size"), which counts the checkpoint pages a tool maps from disk. This
samples the private (anonymous) resident memory, RssAnon of /proc/PID/status, of the command and its
children every 20 ms and reports the peak of the sum, beside VmHWM and the CPU time of the command and its
children (user + sys, from wait4). Standard library only; Linux.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    peak = {"private_kb": 0, "hwm_kb": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            procs = tree(pid)
            peak["private_kb"] = max(peak["private_kb"], sum(status_kb(p, "RssAnon") for p in procs))
            peak["hwm_kb"] = max(peak["hwm_kb"], max((status_kb(p, "VmHWM") for p in procs), default=0))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    done.set()
    t.join()
    cpu = ru.ru_utime + ru.ru_stime
    threads = os.cpu_count() or 1
    res = {
        "command": cmd,
        "exit_code": os.waitstatus_to_exitcode(status),
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "cpu_utilisation": round(cpu / wall / threads, 3) if wall > 0 else 0.0,
        "cpus": threads,
        "peak_private_bytes": peak["private_kb"] * 1024,
        # ru_maxrss (KB) is the largest child's high-water mark, the figure /usr/bin/time prints.
        "peak_rss_bytes": max(peak["hwm_kb"], ru.ru_maxrss) * 1024,
    }
    print(
        f"peak_private.py: exit {res['exit_code']}, wall {wall:.1f} s, CPU {100 * res['cpu_utilisation']:.0f} % "
        f"of {threads}, peak private {res['peak_private_bytes'] / 1e9:.2f} GB, peak RSS {res['peak_rss_bytes'] / 1e9:.2f} GB",
        file=sys.stderr,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return res["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
