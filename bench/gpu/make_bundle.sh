#!/bin/bash
# Copies what bench/gpu/run_gpu_bench.py runs out of a build folder into a bundle of the same
# layout, with lib/ holding the shared libraries a machine without gRPC, abseil, protobuf or
# prometheus-cpp lacks (OpenCL, MPI and the C/C++ runtimes stay the host's own). For GPU hosts
# that have Open MPI and an OpenCL loader but not the rest of epserve's dependencies.
#
#   bench/gpu/make_bundle.sh build gpu-bundle
set -euo pipefail
build=${1:?usage: make_bundle.sh BUILD OUT}
out=${2:?usage: make_bundle.sh BUILD OUT}
# (bench_exchange and bench_expert_ffn run on the GPU host's CPU: a quiet many-core machine for
# the exchange, and a CPU with AVX512-BF16 and a newer PoCL for the kernels.)
binaries=(tests/kernels/kernels_test bench/kernels/bench_expert_ffn bench/gpu/bench_ffn_gpu
          bench/gpu/probe_wgmma bench/gpu/probe_local_memory
          bench/e2e/bench_e2e_inprocess bench/gpu/bench_device_exchange
          server/epserve client/epserve-load bench/exchange/bench_exchange
          bench/frontend/bench_frontend)
# Built only where the CUDA toolkit was found.
if [ -x "$build/bench/gpu/probe_device_heap" ]; then binaries+=(bench/gpu/probe_device_heap); fi
# The AMX probe runs on the GPU host's CPU (Intel Xeons with AMX).
if [ -x "$build/bench/kernels/probe_amx" ]; then binaries+=(bench/kernels/probe_amx); fi
rm -rf "$out"
mkdir -p "$out/lib"
for b in "${binaries[@]}"; do
  mkdir -p "$out/$(dirname "$b")"
  strip -o "$out/$b" "$build/$b"
done
# Libraries the host provides: the C and C++ runtimes, OpenCL's loader, Open MPI and its
# own dependencies.
# (libmpi_cxx, the C++ bindings, travels: not every Open MPI install has it.)
keep='^(libc\.|libm\.|libdl\.|libpthread\.|librt\.|ld-linux|libgcc_s|libstdc\+\+|libOpenCL|libcuda\.|libmpi\.|libopen-|libhwloc|libevent|libpmix|libudev|libz\.|libcap)'
for b in "${binaries[@]}"; do
  ldd "$build/$b" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $keep ]]; then
    strip -o "$out/lib/$name" "$path" 2>/dev/null || cp -L "$path" "$out/lib/$name"
  fi
done
du -sh "$out"
