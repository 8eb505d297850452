#!/usr/bin/env bash
# Refactors must not change what spark-tool writes. Runs two spark-tool binaries on the fixture
# (quantize W4A8/W4A16, fused and split QKV, 4-bit head, each objective, GGUF Q4_K_M; export-phone f32 and w8a16; run
# --logits-out of the original, both quantized formats and the w8a16 phone graph) and compares every file byte for
# byte. quant_report.json is compared as JSON without the fields that differ from run to run
# (the output path, wall and CPU times, the phase split, peak memory); the artifact marker is new since 2026-12 and skipped,
# and so is quant_report.html (new since 2026-12-02; a rendering of quant_report.json, with its times).
#
#   tools/same_outputs.sh OLD_BINARY NEW_BINARY WORKDIR     (WORKDIR is emptied first)
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") w=$3
cd "$(dirname "$0")/.."
rm -rf "$w"; mkdir -p "$w"
for b in old new; do
  bin=${!b}
  "$bin" quantize fixtures/spark-tiny --format w4a8 --group-size 128 --samples 8 --seq-len 128 --quiet --out "$w/$b/q-w4a8-fused" >/dev/null
  "$bin" quantize fixtures/spark-tiny --format w4a16 --group-size 64 --qkv-layout split --quantize-head --samples 8 --seq-len 128 --quiet --out "$w/$b/q-w4a16-split" >/dev/null
  "$bin" quantize fixtures/spark-tiny --format w4a8 --group-size 64 --qkv-layout split --samples 8 --seq-len 128 --quiet --out "$w/$b/q-w4a8-split" >/dev/null
  "$bin" quantize fixtures/spark-tiny --format w4a16 --group-size 128 --set objective=float-output --samples 8 --seq-len 128 --quiet --out "$w/$b/q-float-output" >/dev/null
  "$bin" quantize fixtures/spark-tiny --format w4a16 --group-size 128 --set objective=quantized-input --samples 8 --seq-len 128 --quiet --out "$w/$b/q-quantized-input" >/dev/null
  "$bin" quantize fixtures/spark-tiny --format q4_k_m --samples 8 --seq-len 128 --quiet --out "$w/$b/q4_k_m.gguf" >/dev/null
  "$bin" export-phone fixtures/spark-tiny --out "$w/$b/phone-f32" --precision f32 --context 256 --quiet
  "$bin" export-phone fixtures/spark-tiny --out "$w/$b/phone-w8a16" --context 256 --calib-samples 2 --calib-seq-len 64 --quiet
  "$bin" run fixtures/spark-tiny --tokens 1,2,3,4 --max-new-tokens 4 --quiet --logits-out "$w/$b/logits.safetensors"
  "$bin" run "$w/$b/q-w4a8-fused" --tokens 1,2,3,4 --max-new-tokens 4 --quiet --logits-out "$w/$b/logits-q.safetensors"
  "$bin" run "$w/$b/q-w4a16-split" --tokens 1,2,3,4 --max-new-tokens 4 --quiet --logits-out "$w/$b/logits-q16.safetensors"
  "$bin" run "$w/$b/phone-w8a16" --tokens 1,2,3,4 --max-new-tokens 4 --quiet --logits-out "$w/$b/logits-phone.safetensors"
done
cd "$w"
n=0; bad=0
while IFS= read -r f; do
  [ "$(basename "$f")" = quant_report.html ] && continue
  n=$((n+1))
  if [ ! -f "new/$f" ]; then echo "missing in new: $f"; bad=1; continue; fi
  if [ "$(basename "$f")" = quant_report.json ]; then
    python3 - "old/$f" "new/$f" <<'PY' || { echo "DIFFERS: $f"; bad=1; }
import json, sys
# What differs from run to run (and, for the phase split, exists only since 2026-12-01).
RUN_DEPENDENT = ("out", "peak_rss_bytes", "peak_private_bytes", "threads", "cpu_utilisation", "phases")
def norm(v):
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items() if k not in RUN_DEPENDENT and "seconds" not in k}
    return [norm(x) for x in v] if isinstance(v, list) else v
def same(a, b):
    # The report's error figures are f64 sums over rayon's threads, whose grouping varies from
    # run to run in the last bits (the weights they describe are compared byte for byte).
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
a, b = (norm(json.load(open(p))) for p in sys.argv[1:])
# Fields the new binary adds to the report are allowed; changed ones are not.
b = {k: v for k, v in b.items() if k in a}
sys.exit(not same(a, b))
PY
  else
    cmp -s "old/$f" "new/$f" || { echo "DIFFERS: $f"; bad=1; }
  fi
done < <(cd old && find . -type f | sort)
extra=$(cd new && find . -type f ! -name .spark-tool-artifact.json ! -name quant_report.html | sort | while read -r f; do [ -f "../old/$f" ] || echo "$f"; done)
[ -z "$extra" ] || { echo "only in new: $extra"; bad=1; }
echo "$n files compared; result: $([ $bad = 0 ] && echo identical || echo DIFFERENT)"
exit $bad
