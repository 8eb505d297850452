#!/usr/bin/env python3
"""Fidelity study of spark-tool's quantizers on a trained checkpoint (docs/FIDELITY.md).

For every recipe (method × GPTQ order) and group size, the model is quantized twice, once from each of two
disjoint calibration subsets, and each checkpoint is compared with the original by `spark-tool parity` in
W4A8 and W4A16 numerics. Every figure of the printed markdown table is the mean of the two runs, with half
their difference (the spread that calibration alone causes) after `±`. Every row is measured in this run.

    python3 tools/fidelity_table.py --testbed tiny --work /tmp/fid-tiny
    python3 tools/fidelity_table.py --testbed docs --work /tmp/fid-docs --json /tmp/fid-docs.json

Testbeds:
  tiny  fixtures/spark-tiny; calibration: the bundled calibration/spark-calib.jsonl split into its even and
        odd documents; prompts calibration/parity_prompts.json; perplexity on calibration/heldout.jsonl.
  docs  fixtures/spark-docs; calibration: calibration/docs/calib-a.jsonl and calib-b.jsonl (disjoint pages
        of the training books); prompts and perplexity from books the model never saw
        (calibration/docs/prompts.json, heldout.jsonl; tools/docs_corpus.py).

Checkpoints already under --work are reused (delete the folder to measure afresh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target/release/spark-tool"

TESTBEDS = {
    "tiny": {
        "model": "fixtures/spark-tiny",
        "split": "calibration/spark-calib.jsonl",
        "prompts": "calibration/parity_prompts.json",
        "eval": "calibration/heldout.jsonl",
    },
    "docs": {
        "model": "fixtures/spark-docs",
        "calib": ["calibration/docs/calib-a.jsonl", "calibration/docs/calib-b.jsonl"],
        "prompts": "calibration/docs/prompts.json",
        "eval": "calibration/docs/heldout.jsonl",
    },
}

def keys(*pairs: str) -> list[str]:
    """`quantize` arguments that set recipe keys (docs/QUANTIZE.md "Recipes")."""
    return [a for kv in pairs for a in ("--set", kv)]


# (row label, quantize arguments). Rows with `lab.` keys need a `--features lab` build.
QI = "objective=quantized-input"
BASE = ("method=gptq-search", "order=act-static")
FO = (*BASE, "objective=float-output")
BT, MT = "lab.block_tune={}", "lab.model_tune={}"
RECIPES = {
    "rtn": keys("method=rtn"),  # RTN has no objective: it rounds W itself
    "gptq": keys("method=gptq", "order=natural", QI),
    "gptq-search": keys("method=gptq-search", "order=natural", QI),
    "gptq-search act-static": keys(*BASE, QI),
    "gptq-search act-static refit1": keys(*BASE, "lab.refit_rounds=1", QI),
    # Each linear reproduces the float model's output (GPTAQ).
    "gptq-search act-static float-output": keys(*FO),
    # The default: out_proj and down_proj also reproduce the share of the float model's residual
    # stream after their add that a split half shows their input predicts.
    "gptq-search act-static float-stream": keys(*BASE, "objective=float-stream"),
    "gptq-search act-static float-stream block-tune": keys(*BASE, "objective=float-stream", BT),
    "gptq-search act-static float-stream block-tune model-tune": keys(*BASE, "objective=float-stream", BT, MT),
    "gptq-search act-static float-output positive": keys(*FO, "signed_scales=false"),
    "gptq-search act-static float-output block-tune": keys(*FO, BT),
    # Keeping each layer's final tuned state instead of the best one scored every 25 steps.
    "gptq-search act-static float-output block-tune last": keys(*FO, BT, "lab.block_tune.check=0"),
    # Tuning with W4A8's per-token int8 rounding of each quantized linear's input.
    "gptq-search act-static float-output block-tune int8": keys(*FO, BT, "lab.block_tune.int8_inputs=true"),
    "gptq-search act-static float-output model-tune": keys(*FO, MT),
    "gptq-search act-static float-output block-tune model-tune": keys(*FO, BT, MT),
    "gptq-search act-static float-output model-tune int8": keys(*FO, MT, "lab.model_tune.int8_inputs=true"),
    "gptq-search act-static float-output block-tune model-tune int8": keys(
        *FO, BT, MT, "lab.model_tune.int8_inputs=true"),
    "gptq-search act-static float-output block-tune model-tune codes": keys(
        *FO, BT, MT, "lab.model_tune.codes_lr=1e-2"),
    "gptq-search act-static float-output f32-forward": keys(*FO, "forward_precision=f32"),
    "gptq-search act-static float-output cd4": keys(*FO, "lab.descent_passes=4"),
    "gptq-search act-static float-output cd16": keys(*FO, "lab.descent_passes=16"),
    # GPTQ's damping λ (a fraction of the mean diag(H)) as a regulariser: default 0.01.
    **{f"gptq-search act-static float-output damp{d}": keys(*FO, f"damp={d}")
       for d in ["0.001", "0.03", "0.1", "0.3"]},
    "gptq-search act-static float-output refit1": keys(*FO, "lab.refit_rounds=1"),
}
METRICS = ["kl_mean", "kl_p99", "top1", "top5", "greedy_identical", "ppl_ratio"]


def calibration_sets(tb: dict, work: Path) -> list[Path]:
    if "calib" in tb:
        return [ROOT / p for p in tb["calib"]]
    lines = (ROOT / tb["split"]).read_text(encoding="utf-8").splitlines()
    sets = []
    for i, name in enumerate(["calib-even.jsonl", "calib-odd.jsonl"]):
        p = work / name
        p.write_text("\n".join(lines[i::2]) + "\n", encoding="utf-8")
        sets.append(p)
    return sets


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):  # parity exits 1 on drift beyond its default policy: still a result
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", choices=sorted(TESTBEDS), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--groups", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    ap.add_argument("--calibration", type=Path, nargs=2, metavar=("SUBSET_A", "SUBSET_B"),
                    help="two calibration files instead of the testbed's own (e.g. tools/self_calibration.py)")
    ap.add_argument("--spark-tool", type=Path, default=BIN, help="the binary (default: target/release/spark-tool)")
    a = ap.parse_args()
    binary = str(a.spark_tool)
    tb = TESTBEDS[a.testbed]
    a.work.mkdir(parents=True, exist_ok=True)
    sets = list(a.calibration) if a.calibration else calibration_sets(tb, a.work)
    rows, raw = [], []
    for recipe in a.recipes:
        for g in a.groups:
            per_numerics: dict[str, list[dict]] = {"w4a8": [], "w4a16": []}
            bpw = None
            for si, calib in enumerate(sets):
                ckpt = a.work / f"{recipe.replace(' ', '_')}-g{g}-c{si}"
                if not (ckpt / "config.json").exists():
                    run([binary, "quantize", tb["model"], *RECIPES[recipe], "--format", "w4a16",
                         "--group-size", str(g), "--calibration", str(calib), "--samples", str(a.samples),
                         "--seq-len", str(a.seq_len), "--no-compare", "--quiet", "--force", "--out", str(ckpt)])
                for numerics in per_numerics:
                    js = ckpt.with_name(ckpt.name + f"-{numerics}.json")
                    run([binary, "parity", tb["model"], str(ckpt), "--w4-numerics", numerics,
                         "--prompts", tb["prompts"], "--eval-text", tb["eval"],
                         "--eval-tokens", str(a.eval_tokens), "--json", str(js)])
                    r = json.loads(js.read_text())
                    bpw = r["candidate_bpw"]
                    per_numerics[numerics].append(r["overall"])
                    raw.append({"recipe": recipe, "group": g, "calibration": str(calib), "numerics": numerics,
                                "bpw": bpw, **{m: r["overall"][m] for m in METRICS + ["prompts", "positions"]}})
            for numerics, runs in per_numerics.items():
                rows.append((recipe, g, numerics, bpw, runs))
    print(f"testbed {a.testbed}: {tb['model']}, calibration {', '.join(str(s) for s in sets)} "
          f"({a.samples} x {a.seq_len} tokens each); prompts {tb['prompts']}; perplexity on {a.eval_tokens} "
          f"tokens of {tb['eval']}. Mean of the two calibration subsets ± half their difference.")
    print()
    print("| recipe | group | numerics | bpw | KL mean | KL p99 | top-1 | top-5 | greedy | ppl ratio |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")

    def pm(vals, fmt):
        m, h = sum(vals) / len(vals), (max(vals) - min(vals)) / 2
        return f"{fmt(m)} ± {fmt(h)}"

    e = lambda v: f"{v:.3e}"  # noqa: E731
    f4 = lambda v: f"{v:.4f}"  # noqa: E731
    for recipe, g, numerics, bpw, runs in rows:
        col = lambda m: [r[m] for r in runs]  # noqa: E731
        greedy = "/".join(str(r["greedy_identical"]) for r in runs) + f" of {runs[0]['prompts']}"
        print(f"| {recipe} | {g} | {numerics} | {bpw:.3f} | {pm(col('kl_mean'), e)} | {pm(col('kl_p99'), e)} "
              f"| {pm(col('top1'), f4)} | {pm(col('top5'), f4)} | {greedy} | {pm(col('ppl_ratio'), f4)} |")
    if a.json:
        a.json.write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
