#!/usr/bin/env python3
"""Calibration text sampled from the model itself (docs/FIDELITY.md "Self-generated calibration").

Each sample is `spark-tool run MODEL --temperature T --seed S --ignore-eos` from the beginning-of-sequence
token alone, so nothing but the model decides what the text is about; seeds `--first-seed`,
`--first-seed + 1`, … make the set reproducible. One JSON line per sample, `{"source": "self-generated",
"seed": S, "text": ...}`, the layout `quantize --calibration` reads.

    python3 tools/self_calibration.py --model fixtures/spark-tiny --out /tmp/self-a.jsonl --samples 128
    python3 tools/self_calibration.py --model fixtures/spark-tiny --out /tmp/self-b.jsonl --samples 128 --first-seed 1000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOS = "<｜start▁of▁sentence｜>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=600, help="new tokens per sample (≥ quantize's --seq-len)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--spark-tool", type=Path, default=ROOT / "target/release/spark-tool")
    a = ap.parse_args()
    if a.out.exists():
        sys.exit(f"{a.out} exists: choose a new file (this tool never overwrites)")
    lines = []
    for i in range(a.samples):
        seed = a.first_seed + i
        r = subprocess.run([str(a.spark_tool), "run", str(a.model), "--prompt", BOS, "--temperature",
                            str(a.temperature), "--seed", str(seed), "--max-new-tokens", str(a.tokens),
                            "--ignore-eos"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"spark-tool run failed for seed {seed}: {r.stderr[-1000:]}")
        lines.append(json.dumps({"source": "self-generated", "seed": seed, "text": BOS + r.stdout},
                                ensure_ascii=False))
    tmp = a.out.with_name(a.out.name + ".partial")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.rename(a.out)
    print(f"{a.out}: {a.samples} samples of {a.tokens} tokens at temperature {a.temperature}")


if __name__ == "__main__":
    main()
