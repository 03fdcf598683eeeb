"""KTransformers' CPU experts (kt-kernel): BF16 weights through AMXBF16_MOE where the wheel's
AVX512-BF16/AMX build loads, AVX2BF16_MOE elsewhere; kt-kernel has no FP32-weight path.
Driven the way kt_kernel.utils.amx.NativeMoEWrapper drives it (MOEConfig with per-expert
weight pointers, load_weights_task, forward_task on a CPUInfer pool), without the wrapper's
GPU-side buffers."""

import os

import torch

from .common import Unsupported

_MAX_TOKENS = 4096
_backend = None


def version():
    import kt_kernel
    return f"kt-kernel {kt_kernel.__version__} {_backend or ''}".strip()


def bf16(w):
    try:
        import kt_kernel  # selects the CPU variant and registers kt_kernel_ext
        import kt_kernel_ext
    except ImportError as e:
        raise Unsupported(f"kt_kernel does not import: {e}")
    moe_mod = kt_kernel_ext.moe
    cls = getattr(moe_mod, "AMXBF16_MOE", None) or getattr(moe_mod, "AVX2BF16_MOE", None)
    if cls is None:
        raise Unsupported("kt_kernel has neither AMXBF16_MOE nor AVX2BF16_MOE")

    global _backend
    _backend = f"{cls.__name__} ({kt_kernel.__cpu_variant__})"
    pool_config = kt_kernel_ext.WorkerPoolConfig()
    pool_config.subpool_count = 1
    pool_config.subpool_numa_map = [0]
    pool_config.subpool_thread_count = [torch.get_num_threads()]
    cpu_infer = kt_kernel_ext.CPUInfer(pool_config)

    gate, up, down = (t.to(torch.bfloat16).contiguous() for t in (w.gate, w.up, w.down))
    no_gpu_experts = torch.zeros(w.num_experts, dtype=torch.bool)
    config = moe_mod.MOEConfig(w.num_experts, w.top_k, w.hidden, w.ffn,
                               no_gpu_experts.data_ptr())
    config.layer_idx = 0
    config.pool = cpu_infer.backend_
    config.max_len = _MAX_TOKENS
    config.gate_projs = [[gate[e].data_ptr() for e in range(w.num_experts)]]
    config.up_projs = [[up[e].data_ptr() for e in range(w.num_experts)]]
    config.down_projs = [[down[e].data_ptr() for e in range(w.num_experts)]]
    no_scales = [[0] * w.num_experts]
    config.gate_scales, config.up_scales, config.down_scales = no_scales, no_scales, no_scales
    moe = cls(config)
    identity_map = torch.arange(w.num_experts, dtype=torch.int64)
    cpu_infer.submit(moe.load_weights_task(identity_map.data_ptr()))
    cpu_infer.sync()
    # The kernels read the weights in place: they must outlive the closure, as must the mask
    # and map MOEConfig points at.
    keep = (gate, up, down, no_gpu_experts, identity_map)

    def routed(x, topk_weights, topk_ids):
        if x.dtype != torch.bfloat16:
            raise Unsupported("kt-kernel's BF16 experts take BF16 activations")
        if x.shape[0] > _MAX_TOKENS:
            raise Unsupported(f"more than {_MAX_TOKENS} tokens per call")
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        bsz = torch.tensor([x.shape[0]], dtype=torch.int32)
        cpu_infer.submit(moe.forward_task(bsz.data_ptr(), ids.shape[1], ids.data_ptr(),
                                          weights.data_ptr(), x.data_ptr(), out.data_ptr(),
                                          False))
        cpu_infer.sync(0)
        assert keep
        return out

    return routed


def fp32(w):
    raise Unsupported("kt-kernel has no FP32-weight MoE (BF16, FP8 and integer formats only)")


VARIANTS = {
    "kt-kernel-fp32": ("fp32", fp32),
    "kt-kernel-bf16": ("bf16", bf16),
}
