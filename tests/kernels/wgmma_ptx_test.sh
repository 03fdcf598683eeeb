#!/usr/bin/env bash
# The 128-row wgmma kernels keep their products asynchronous: kernels/cl/expert_ffn_mma.cl built
# to PTX by clang (OpenCL C for nvptx64 with the runtime's wgmma options), its wgmma marks made
# live and its target sm_90a as the runtime does (kernels/detail/ptx_patch.h), then assembled by
# ptxas at the wgmma program's register cap (168: three work-groups of 128 on an H100 or H200),
# which must inject no warpgroup.arrive or warpgroup.wait into ffn_mma_gate_up, ffn_mma_down or
# ffn_mma_partial. It does where a branch falls between the wgmma instructions: on an H200 that
# cost the full tiles 7%, and NVIDIA's driver built it without a warning (docs/ARCHITECTURE.md,
# "Short tiles multiply half"). clang's PTX is not NVIDIA's compiler's (registers and spills
# differ), so only the injections are checked. Skipped (77) without clang's NVPTX target or a
# ptxas that knows sm_90a (the CUDA toolkit, on PATH or in /usr/local/cuda/bin).
#   wgmma_ptx_test.sh SOURCE_DIR
set -euo pipefail
src="$1"
ptxas=$(command -v ptxas || true)
[ -z "$ptxas" ] && [ -x /usr/local/cuda/bin/ptxas ] && ptxas=/usr/local/cuda/bin/ptxas
if [ -z "$ptxas" ] || ! command -v clang >/dev/null ||
   ! clang --print-targets 2>/dev/null | grep -q nvptx64; then
  echo "skipped: needs clang with the NVPTX target and ptxas (the CUDA toolkit)"
  exit 77
fi
# The runtime's values for the wgmma program: the decode form's rows and the register cap
# (kernels/detail/ffn_layout.h's kMmaDecodeRows, and the cap its static_assert pins).
layout="$src/kernels/detail/ffn_layout.h"
dec_rows=$(sed -n 's/.*kMmaDecodeRows = \([0-9]*\);.*/\1/p' "$layout")
cap=$(sed -n 's/.*MmaRegisterCap(kMmaDefaultRegisters, kMmaWgmmaWorkGroups) == \([0-9]*\)).*/\1/p' \
  "$layout")
if [ -z "$dec_rows" ] || [ -z "$cap" ]; then
  echo "FAIL: kMmaDecodeRows or the wgmma register cap not found in $layout"
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# OpenCL's work-item functions and the few built-ins the kernels call, as NVVM's, since clang
# links no OpenCL library for nvptx64; every function inlined, as NVIDIA's compiler does.
cat > "$work/prelude.h" <<'H'
#define NV_XYZ(r, d) \
  ((d) == 0 ? __nvvm_read_ptx_sreg_##r##_x() \
            : (d) == 1 ? __nvvm_read_ptx_sreg_##r##_y() : __nvvm_read_ptx_sreg_##r##_z())
#define get_local_id(d) NV_XYZ(tid, d)
#define get_group_id(d) NV_XYZ(ctaid, d)
#define get_num_groups(d) NV_XYZ(nctaid, d)
#define get_local_size(d) NV_XYZ(ntid, d)
#define get_global_id(d) (get_group_id(d) * get_local_size(d) + get_local_id(d))
#define barrier(flags) __nvvm_bar_sync(0)
#define exp(x) __nvvm_ex2_approx_f((x) * 1.4426950408889634f)
#define min(a, b) ((a) < (b) ? (a) : (b))
#define max(a, b) ((a) > (b) ? (a) : (b))
H
sed 's/^inline /static inline __attribute__((always_inline)) /' \
  "$src/kernels/cl/expert_ffn_mma.cl" > "$work/mma.cl"
clang -x cl -cl-std=CL1.2 -target nvptx64-nvidia-nvcl -march=sm_80 -O2 -S \
  -Xclang -finclude-default-header -include "$work/prelude.h" \
  -DMMA_DEC_BM="$dec_rows" -DMMA_WGMMA=1 \
  "$work/mma.cl" -o "$work/mma.ptx"
# The runtime's patch: the marked instructions live, the target sm_90a.
sed -e 's#// @W@ ##' -e 's/^\.target sm_80/.target sm_90a/' -e 's/^\.version .*/.version 8.0/' \
  "$work/mma.ptx" > "$work/mma_90a.ptx"
grep -q 'wgmma.mma_async' "$work/mma_90a.ptx" || { echo "FAIL: no wgmma in the PTX"; exit 1; }
if ! "$ptxas" -arch=sm_90a -v -maxrregcount="$cap" "$work/mma_90a.ptx" -o "$work/mma.cubin" \
     > "$work/ptxas.log" 2>&1; then
  if grep -q "sm_90a" "$work/ptxas.log" &&
     grep -qi "not defined\|unsupported\|unknown" "$work/ptxas.log"; then
    echo "skipped: this ptxas does not assemble sm_90a"
    exit 77
  fi
  cat "$work/ptxas.log"
  echo "FAIL: ptxas did not assemble the wgmma program"
  exit 1
fi
injected=$(grep -E "is injected.*'ffn_mma_(gate_up|down|partial)'" "$work/ptxas.log" || true)
if [ -n "$injected" ]; then
  echo "$injected"
  echo "FAIL: the assembler waits on the wgmma products in the 128-row kernels" \
       "(a branch among them?)"
  exit 1
fi
echo "ok: $(grep -c 'wgmma.mma_async' "$work/mma_90a.ptx") wgmma instructions," \
     "none waited on by the assembler"
