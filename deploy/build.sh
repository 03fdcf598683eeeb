#!/usr/bin/env bash
# Configures and builds epserve into ${BUILD_DIR:-build}. Extra arguments go to cmake.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
# CMake's code model for tests/portability/layering_test.sh, from the first configure on (the
# top CMakeLists.txt asks for it too, which takes effect from the second).
mkdir -p "$build/.cmake/api/v1/query" && touch "$build/.cmake/api/v1/query/codemodel-v2"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
