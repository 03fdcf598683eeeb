#!/usr/bin/env bash
# Runs kernels_test's runtime and FFN tests with PoCL building for Haswell (AVX2, FMA, no
# AVX-512), whatever the host is. Usage: haswell_target_test.sh path/to/kernels_test
set -euo pipefail
test_bin="$1"
if [ "$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo || ! grep -qw fma /proc/cpuinfo; then
  echo "skipped: this host cannot run Haswell code (x86_64 with AVX2 and FMA needed)"
  exit 77
fi
if ! ls /etc/OpenCL/vendors/ 2>/dev/null | grep -qi pocl; then
  echo "skipped: PoCL is not an installed OpenCL platform"
  exit 77
fi
export POCL_LLVM_CPU_NAME=haswell POCL_KERNELLIB_NAME=avx2 EPSERVE_EXPECT_TARGET_ISA=avx2
exec "$test_bin" --gtest_filter='RuntimeTest.CpuWidthFollowsTheBuildTarget:ExpertFfnTest.*:FfnBlockingTest.*'
