#!/usr/bin/env bash
# Builds the fuzz targets with clang's libFuzzer (plus ASan and UBSan) and runs each for a
# bounded time on the seed corpus in tests/fuzz/corpus. A crash, a sanitizer report or a
# broken invariant fails the run; the executions per target are printed.
#   tests/fuzz.sh [seconds per target, default 45]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-45}"
"$root/deploy/install-deps.sh"
build="$root/build-fuzz"
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DEPSERVE_FUZZ=ON -DEPSERVE_BUILD_BENCH=OFF -DEPSERVE_FUZZ_SECONDS="$seconds" >/dev/null
cmake --build "$build" -j "$(nproc)" --target fuzz_infer_request fuzz_safetensors fuzz_model_config
ctest --test-dir "$build" -L fuzz -V 2>&1 | tee "$build/fuzz.log" |
  grep -E "^[0-9]+: (stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb)|Test +#|tests passed|ERROR|SUMMARY"
grep -q "100% tests passed" "$build/fuzz.log"
