#!/usr/bin/env bash
# Fidelity study on the trained fixture (docs/FIDELITY.md): RTN / GPTQ / GPTQ + scale search at g128 and
# g64, each executed as W4A8 and W4A16, compared with the original by `spark-tool parity` on the bundled
# held-out prompts. Prints a markdown table; every row is measured in this run.
#   tools/fidelity_table.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
cargo build --release -q
bin=target/release/spark-tool
echo "| method | group | numerics | bpw (all tensors) | KL mean | KL p99 | top-1 | top-5 | greedy | ppl ratio |"
echo "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"
for method in rtn gptq gptq-search; do
  for g in 128 64; do
    ckpt="$out/$method-g$g"
    [ -f "$ckpt/config.json" ] || $bin quantize --method "$method" --format w4a16 --group-size "$g" \
      --no-compare --quiet --force --out "$ckpt" > /dev/null
    for numerics in w4a8 w4a16; do
      $bin parity fixtures/spark-tiny "$ckpt" --w4-numerics "$numerics" --json "$out/$method-g$g-$numerics.json" > /dev/null || true
      python3 - "$out/$method-g$g-$numerics.json" "$method" "$g" "$numerics" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); o = r["overall"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {r['candidate_bpw']:.3f} | {o['kl_mean']:.2e} | {o['kl_p99']:.2e} "
      f"| {o['top1']:.4f} | {o['top5']:.4f} | {o['greedy_identical']}/{o['prompts']} | {o['ppl_ratio']:.4f} |")
PY
    done
  done
done
