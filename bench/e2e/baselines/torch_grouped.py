"""PyTorch's own routed experts (PyPI torch >= 2.8, run on the CPU): torch._grouped_mm over
the (token, expert) rows sorted by expert, FP32 and BF16, beside the Hugging-Face-style loop
under the same torch."""

import torch
import torch.nn.functional as F

from .common import Unsupported, hf_loop


def version():
    return f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


def grouped_mm(w):
    if not hasattr(torch, "_grouped_mm"):
        raise Unsupported(f"torch {torch.__version__} has no torch._grouped_mm")
    # mat_b of _grouped_mm is [E, K, N]: gate and up fused along N, down as [E, F, H].
    w13 = torch.cat([w.gate, w.up], dim=1).transpose(1, 2).contiguous()  # [E, H, 2F]
    w2 = w.down.transpose(1, 2).contiguous()  # [E, F, H]
    num_experts, ffn = w.num_experts, w.ffn

    def routed(x, topk_weights, topk_ids):
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        token = order // topk_ids.shape[1]
        offs = torch.cumsum(torch.bincount(flat_ids, minlength=num_experts), 0,
                            dtype=torch.int32)
        rows = x.index_select(0, token)
        h = torch._grouped_mm(rows, w13, offs=offs)
        h = F.silu(h[:, :ffn]) * h[:, ffn:]
        h = torch._grouped_mm(h, w2, offs=offs)
        h = h * topk_weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, h)

    return routed


def loop(w):
    return hf_loop(w)


VARIANTS = {
    "torch-grouped-mm-fp32": ("fp32", grouped_mm),
    "torch-grouped-mm-bf16": ("bf16", grouped_mm),
    "torch-loop-fp32": ("fp32", loop),
    "torch-loop-bf16": ("bf16", loop),
}
