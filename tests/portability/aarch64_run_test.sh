#!/usr/bin/env bash
# The targets that need no OpenCL, MPI or gRPC (-DEPSERVE_PORTABLE_ONLY=ON: common/, model/,
# tools/epserve-inspect, the common and model gtests, the model's fuzz replays) cross-built
# for aarch64 with cmake/aarch64-linux-gnu.cmake, linked against Debian's arm64 libraries,
# and their tests run under qemu-user. Any failing test fails this one. The rest (kernels/,
# shmem/, worker/, server/, client/) is compile-checked only, by aarch64_test.sh.
# Skipped (77) on an aarch64 host (the default build runs there) and where the cross
# compiler, qemu-aarch64 or the arm64 libraries are missing (deploy/install-deps.sh installs
# them).
#   aarch64_run_test.sh SOURCE_DIR CROSS_BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(uname -m)" != aarch64 ] || skip "the host is aarch64: the default build runs the tests"
command -v aarch64-linux-gnu-g++ >/dev/null ||
  skip "no aarch64-linux-gnu-g++ (package g++-aarch64-linux-gnu)"
command -v qemu-aarch64 >/dev/null || skip "no qemu-aarch64 (package qemu-user)"
[ -e /lib/ld-linux-aarch64.so.1 ] || skip "no arm64 runtime (package libc6:arm64)"
arch_cmake=/usr/lib/aarch64-linux-gnu/cmake
[ -f $arch_cmake/absl/abslConfig.cmake ] || skip "no arm64 abseil (package libabsl-dev:arm64)"
[ -f $arch_cmake/GTest/GTestConfig.cmake ] ||
  skip "no arm64 googletest (package libgtest-dev:arm64)"

jobs=$(nproc)
log="$build/build.log"
mkdir -p "$build"
start=$SECONDS
if ! { cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_TOOLCHAIN_FILE="$src/cmake/aarch64-linux-gnu.cmake" \
         -DEPSERVE_PORTABLE_ONLY=ON -DEPSERVE_WERROR=ON &&
       cmake --build "$build" -j "$jobs"; } >"$log" 2>&1; then
  tail -50 "$log"; echo "aarch64 cross build failed (log: $log)"; exit 1
fi
built=$SECONDS
ctest --test-dir "$build" -j "$jobs" --output-on-failure --timeout 300 --no-tests=error
echo "aarch64: built in $((built - start)) s," \
  "tests run under qemu-aarch64 in $((SECONDS - built)) s"
