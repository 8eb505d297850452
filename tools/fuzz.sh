#!/usr/bin/env bash
# Fuzz every cargo-fuzz target in fuzz/ for SECONDS_PER_TARGET (default 60) with libFuzzer,
# AddressSanitizer and debug assertions (overflow checks); fails on the first crash, panic,
# leak, timeout (> 10 s on one input) or OOM (> 4 GiB), leaving the input in
# fuzz/artifacts/<target>/. docs/RELIABILITY.md (fuzzing) says what each target feeds.
#
#   tools/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Pins: cargo-fuzz $CARGO_FUZZ_VERSION (installed with --locked when missing) on the stable
# toolchain $FUZZ_TOOLCHAIN. AddressSanitizer needs the nightly-only `-Zsanitizer=address`, so
# the script sets RUSTC_BOOTSTRAP=1 for it (no nightly is downloaded); FUZZ_SANITIZER=none
# fuzzes on plain stable without it. FUZZ_TOOLCHAIN=nightly-YYYY-MM-DD works too. Corpora grow
# in fuzz/corpus/<target> (git-ignored), starting from the committed seeds in
# fuzz/seeds/<target> (regenerate them with fuzz/make_seeds.py).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

secs=${1:-60}
shift $(($# > 0 ? 1 : 0))
CARGO_FUZZ_VERSION=${CARGO_FUZZ_VERSION:-0.13.2}
FUZZ_TOOLCHAIN=${FUZZ_TOOLCHAIN:-1.95.0}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-address}

# The default toolchain serves when it is that release; otherwise rustup installs the pin.
if [[ "$(rustc --version)" == "rustc $FUZZ_TOOLCHAIN "* ]]; then
  fuzz=(cargo fuzz)
else
  if ! rustup run "$FUZZ_TOOLCHAIN" rustc --version >/dev/null 2>&1; then
    rustup toolchain install "$FUZZ_TOOLCHAIN" --profile minimal
  fi
  fuzz=(cargo "+$FUZZ_TOOLCHAIN" fuzz)
fi
if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi
if [ "$FUZZ_SANITIZER" != none ]; then export RUSTC_BOOTSTRAP=1; fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then mapfile -t targets < <("${fuzz[@]}" list); fi

start=$SECONDS
"${fuzz[@]}" build -a --sanitizer "$FUZZ_SANITIZER"
echo "== build: $((SECONDS - start)) s" >&2

summary=()
TIMEFORMAT="%R s wall, %U s user + %S s sys"
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log="artifacts/$t/last-run.log"
  if ! took=$( { time "${fuzz[@]}" run -a --sanitizer "$FUZZ_SANITIZER" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
      -print_final_stats=1 >"$log" 2>&1; } 2>&1 ); then
    tail -n 60 "$log" >&2
    echo "FUZZ FAILURE in $t: input kept in fuzz/artifacts/$t/, full log $log" >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  summary+=("$t: $took, ${execs:-?} execs, corpus $(find "corpus/$t" -type f | wc -l) files")
  echo "== ${summary[-1]}" >&2
done
printf '%s\n' "${summary[@]}"
