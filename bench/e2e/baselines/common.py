"""What every baseline shares: the weights bench_e2e_dump_weights wrote, the routing and the
shared expert (computed here, in PyTorch, the same way for every variant, so that only the
routed-expert kernel differs between them) and the Hugging-Face-style expert loop that serves
as the reference."""

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


DENSE = ("router", "shared_gate", "shared_up", "shared_down", "shared_expert_gate")


# Extensions past AVX2 and FMA, which EPSERVE_BENCH_ISA=avx2 (bench_e2e.py --isa=avx2) hides.
_PAST_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")


def cpu_flags():
    """The CPU's flags, less those past AVX2 where EPSERVE_BENCH_ISA=avx2 says to keep to it."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if os.environ.get("EPSERVE_BENCH_ISA") == "avx2":
        flags = {f for f in flags if not f.startswith(_PAST_AVX2)}
    return flags


def dense_dtype(dtype):
    """The dtype the router and shared-expert GEMMs run in. BF16 weights run as FP32 GEMMs on
    their BF16-rounded values unless the CPU has BF16 dot products: torch's BF16 matmul on an
    AVX2 CPU reaches ~10 GFLOP/s against ~85 for FP32 (Zen 3, torch 2.15, 512 x 2048 x 5632),
    which would swamp every routed kernel behind the same shared expert."""
    if dtype == torch.bfloat16 and not {"avx512_bf16", "amx_bf16"} & cpu_flags():
        return torch.float32
    return dtype


class Unsupported(Exception):
    """A variant that has no path on this machine (or for this dtype); the message says why."""


_TENSORS = ("router", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
            "shared_expert_gate")


class Weights:
    """One MoE layer's weights in Hugging Face's layout, rounded to `dtype`: the experts gate,
    up [E, F, H] and down [E, H, F] held in `dtype`; router [E, H], shared_gate, shared_up
    [Fs, H], shared_down [H, Fs] and shared_expert_gate [1, H] (None where absent) held in
    dense_dtype(dtype). cfg is the dump's config.json (hidden, ffn, experts, top_k,
    norm_topk_prob, ...)."""

    def __init__(self, weights_dir, dtype):
        with open(os.path.join(weights_dir, "config.json")) as f:
            self.cfg = json.load(f)
        if self.cfg["routing"] != "softmax_topk":
            raise ValueError(f"routing {self.cfg['routing']} is not softmax top-k")
        self.dtype = dtype
        self.dense_dtype = dense_dtype(dtype)

        def load(name):
            path = os.path.join(weights_dir, name + ".npy")
            if not os.path.exists(path):
                return None
            array = np.load(path, mmap_mode="r")
            # torch's allocator aligns to 64 bytes, as the kernels that use the weights in
            # place (ggml) require; numpy's buffers need not be.
            out = torch.empty(array.shape, dtype=dtype)
            for i in range(array.shape[0]):  # one expert (or row) at a time: no 2nd copy
                out[i].copy_(torch.from_numpy(np.array(array[i])))
            return out.to(self.dense_dtype) if name in DENSE else out

        for name in _TENSORS:
            setattr(self, name, load(name))
        self.num_experts = self.cfg["experts"]
        self.top_k = self.cfg["top_k"]
        self.hidden = self.cfg["hidden"]
        self.ffn = self.cfg["ffn"]

    def cast(self, dtype):
        """A copy holding every tensor converted to `dtype` (e.g. BF16-rounded weights
        widened back to FP32 for a reference)."""
        other = object.__new__(Weights)
        other.__dict__.update(self.__dict__)
        other.dtype = other.dense_dtype = dtype
        for name in _TENSORS:
            t = getattr(self, name)  # rounded to self.dtype already
            setattr(other, name, None if t is None else t.to(dtype))
        return other


def route(x, w):
    """Qwen2-MoE's routing: router linear (in w.dense_dtype), softmax in FP32, top-k,
    renormalised only where norm_topk_prob says so. Returns (topk_weights float32 [T, k],
    topk_ids int64 [T, k])."""
    logits = F.linear(x.to(w.dense_dtype), w.router)
    probs = F.softmax(logits, dim=1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, w.top_k, dim=-1)
    if w.cfg["norm_topk_prob"]:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def shared_expert(x, w):
    """down(silu(gate x) * up x), scaled by sigmoid(shared_expert_gate x) where the layer has
    that gate (in w.dense_dtype); None where the layer has no shared expert."""
    if w.shared_gate is None:
        return None
    x = x.to(w.dense_dtype)
    y = F.linear(F.silu(F.linear(x, w.shared_gate)) * F.linear(x, w.shared_up), w.shared_down)
    if w.shared_expert_gate is not None:
        y = torch.sigmoid(F.linear(x, w.shared_expert_gate)) * y
    return y


def layer(x, w, routed):
    """The whole layer around one routed-expert kernel: route, routed(x, topk_weights,
    topk_ids), plus the shared expert."""
    topk_weights, topk_ids = route(x, w)
    y = routed(x, topk_weights, topk_ids)
    s = shared_expert(x, w)
    return y if s is None else y + s.to(y.dtype)


def reference(x, w):
    """What a variant is checked against: the routing exactly as the variant gets it (from x
    and w in their own dtype, so that a near-tie between experts cannot flip between the
    two), then the loop and the shared expert in FP32 on the same values widened."""
    topk_weights, topk_ids = route(x, w)
    w32 = w.cast(torch.float32)
    x32 = x.float()
    y = hf_loop(w32)(x32, topk_weights, topk_ids)
    s = shared_expert(x32, w32)
    return y if s is None else y + s


def hf_loop(w):
    """Routed experts the way transformers' Qwen2MoeSparseMoeBlock loops over them: for each
    expert hit, index_select its rows, gate/up/down with F.linear, scale by the routing weight
    (cast to x's dtype), index_add_ into the output."""

    def routed(x, topk_weights, topk_ids):
        out = torch.zeros_like(x)
        weights = topk_weights.to(x.dtype)
        mask = F.one_hot(topk_ids, num_classes=w.num_experts).permute(2, 1, 0)  # [E, k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for e in hit:
            idx, top_x = torch.where(mask[e])
            rows = x.index_select(0, top_x)
            h = F.linear(F.silu(F.linear(rows, w.gate[e])) * F.linear(rows, w.up[e]), w.down[e])
            out.index_add_(0, top_x, h * weights[top_x, idx, None])
        return out

    return routed
