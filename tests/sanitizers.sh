#!/usr/bin/env bash
# The sanitizer runs of CI: the unit and end-to-end tests built with AddressSanitizer +
# UndefinedBehaviorSanitizer, and the batcher's and the heap's tests built with
# ThreadSanitizer. Any report fails the run (UBSan is fatal, ASan aborts on error).
#   tests/sanitizers.sh [address|thread|all]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
which="${1:-all}"
"$root/deploy/install-deps.sh"
source "$root/deploy/env.sh"

if [ "$which" = address ] || [ "$which" = all ]; then
  echo "== ASan + UBSan: build"
  BUILD_DIR="$root/build-asan" "$root/deploy/build.sh" -DEPSERVE_SANITIZE=address \
    -DEPSERVE_BUILD_BENCH=OFF -DEPSERVE_WERROR=OFF  # GCC 12 warns falsely under -fsanitize
  echo "== ASan + UBSan: unit and end-to-end tests"
  # Leaks are not checked: Open MPI and the OpenCL runtime keep allocations until exit.
  # The deploy tests are left out: they bound memory, which ASan's quarantine inflates.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_odr_violation=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir "$root/build-asan" -LE "bench|long|fuzz|python|deploy|portability" --output-on-failure \
      --timeout 1200
fi

if [ "$which" = thread ] || [ "$which" = all ]; then
  echo "== TSan: build the batcher's and the heap's tests"
  cmake -S "$root" -B "$root/build-tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DEPSERVE_SANITIZE=thread -DEPSERVE_BUILD_BENCH=OFF >/dev/null
  cmake --build "$root/build-tsan" -j "$(nproc)" --target server_test shmem_test
  echo "== TSan: batcher and heap tests"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir "$root/build-tsan" -R "^(Batcher|shmem_|MemoryBudget)" --output-on-failure --timeout 600
fi
