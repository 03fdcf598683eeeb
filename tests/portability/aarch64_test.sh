#!/usr/bin/env bash
# Every C++ source of the libraries and tools compiles for aarch64 (Arm servers: Grace,
# Graviton, Ampere): a syntax and type check with Debian's cross compiler against the host's
# architecture-independent headers (abseil, gRPC, protobuf, Open MPI's mpi.h, OpenCL), so an
# x86-only intrinsic or header outside an architecture guard fails here. It does not link or
# run; aarch64_run_test.sh does, for the targets that need no OpenCL, MPI or gRPC (there are
# no arm64 builds of those here). Skipped (77) without aarch64-linux-gnu-g++.
#   aarch64_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
cxx=aarch64-linux-gnu-g++
command -v $cxx >/dev/null || { echo "SKIPPED: no $cxx (package g++-aarch64-linux-gnu)"; exit 77; }
mpi_include=$(mpicxx --showme:incdirs 2>/dev/null | tr ' ' '\n' | head -1)
cd "$src"
files=$(ls common/*.cc shmem/*.cc worker/*.cc kernels/*.cc model/*.cc server/*.cc app/*.cc client/*.cc tools/*.cc \
  2>/dev/null)
failed=0
for f in $files; do
  if ! out=$($cxx -std=c++20 -fsyntax-only -Werror -Wall -Wextra -Wno-unused-parameter \
      -I. -I"$build/proto/gen" -isystem "${mpi_include:-/usr/lib/x86_64-linux-gnu/openmpi/include}" \
      -isystem /usr/include -DCL_TARGET_OPENCL_VERSION=120 -DEPSERVE_VERSION='"check"' "$f" 2>&1); then
    echo "== $f"; echo "$out" | head -20; failed=$((failed + 1))
  fi
done
echo "$(echo $files | wc -w) sources checked for aarch64, $failed failed"
[ $failed -eq 0 ]
