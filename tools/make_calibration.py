#!/usr/bin/env python3
"""Build the bundled calibration set (calibration/spark-calib.jsonl) and the
held-out set reserved for parity (calibration/heldout.jsonl).

Written for Spark's real use: chat turns in its chat frame, tool calls and
tool results in its format, JSON, code, and five languages (project-written
synthetic dialogues, Apache-2.0, seeded so the files are reproducible), plus
English technical prose and Python code from the CPython 3.11 standard
library (PSF License 2.0). The two files share no document; the held-out
one is never read by `quantize`.

    python3 tools/make_calibration.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spark_corpus  # noqa: E402


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "calibration"
    out.mkdir(exist_ok=True)
    synthetic = spark_corpus.synthetic_documents(900, seed=20261129)
    stdlib = spark_corpus.stdlib_documents()
    rng = random.Random(7)
    rng.shuffle(stdlib)
    stdlib = stdlib[:260]
    docs = [("synthetic-dialogue", d) for d in synthetic] + [("cpython-stdlib", d) for d in stdlib]
    rng.shuffle(docs)
    held = docs[: len(docs) // 8]
    calib = docs[len(docs) // 8:]
    for name, part in (("spark-calib.jsonl", calib), ("heldout.jsonl", held)):
        with open(out / name, "w", encoding="utf-8") as f:
            for source, text in part:
                f.write(json.dumps({"source": source, "text": text}, ensure_ascii=False) + "\n")
        print(f"{name}: {len(part)} documents, {sum(len(t) for _, t in part):,} characters")


if __name__ == "__main__":
    main()
