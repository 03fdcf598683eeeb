#!/usr/bin/python3
"""The MoE layer in PyTorch on the CPU, written the way Hugging Face's Qwen2-MoE sparse block
(transformers' Qwen2MoeSparseMoeBlock) computes it: router linear, softmax, top-k
(renormalised where the model says so), a loop over the experts that were hit with
index_select and index_add_, and the shared expert with its sigmoid gate. It loads the .npy
weights bench_e2e_dump_weights wrote, so that it runs the very weights the server serves.

    moe_torch.py --weights DIR --tokens 1,32,512 [--dtype fp32|bf16] [--threads 2]
                 [--input x.npy --output y.npy]

Prints one JSON object per token count: {"tokens":T,"median_ms":X,"tokens_per_s":X,...}.
With --input, also writes the layer's output on those rows (float32) to --output.
Run it with OMP_WAIT_POLICY=PASSIVE and without OPENBLAS_CORETYPE (bench_e2e.py does).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def isa():
    """ATen's kernel level: asked where torch can say (2.x), else as ATEN_CPU_CAPABILITY set
    it (torch 1.13 reads it too), else nothing."""
    backends_cpu = getattr(torch.backends, "cpu", None)
    if backends_cpu is not None:
        return f" {backends_cpu.get_cpu_capability()}"
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    return f" ATEN_CPU_CAPABILITY={forced}" if forced else ""


def linear(weight):
    """nn.Linear without bias holding `weight` [out, in] (no random initialisation first)."""
    layer = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(torch.from_numpy(np.array(weight, dtype=np.float32)),
                                requires_grad=False)
    return layer


class Expert(nn.Module):
    """Qwen2MoeMLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj = linear(gate)
        self.up_proj = linear(up)
        self.down_proj = linear(down)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, weights_dir):
        super().__init__()
        with open(os.path.join(weights_dir, "config.json")) as f:
            cfg = json.load(f)
        if cfg["routing"] != "softmax_topk":
            raise ValueError(f"routing {cfg['routing']} is not Qwen2-MoE's softmax top-k")
        self.cfg = cfg
        self.num_experts = cfg["experts"]
        self.top_k = cfg["top_k"]
        self.norm_topk_prob = cfg["norm_topk_prob"]

        def load(name):
            return np.load(os.path.join(weights_dir, name + ".npy"), mmap_mode="r")

        self.gate = linear(load("router"))
        gate, up, down = load("gate"), load("up"), load("down")
        self.experts = nn.ModuleList(
            [Expert(gate[e], up[e], down[e]) for e in range(self.num_experts)])
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg["shared_ffn"] > 0:
            self.shared_expert = Expert(load("shared_gate"), load("shared_up"),
                                        load("shared_down"))
            if cfg["shared_expert_gate"]:
                self.shared_expert_gate = linear(load("shared_expert_gate"))

    def forward(self, hidden_states):
        num_tokens, hidden_dim = hidden_states.shape
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros((num_tokens, hidden_dim), dtype=hidden_states.dtype)
        # [E, k, T]: which (choice, token) pairs each expert serves.
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.flatten().tolist():
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states.index_select(0, top_x)
            current_hidden_states = (self.experts[expert_idx](current_state)
                                     * routing_weights[top_x, idx, None])
            final_hidden_states.index_add_(0, top_x,
                                           current_hidden_states.to(hidden_states.dtype))

        if self.shared_expert is not None:
            shared_expert_output = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared_expert_output = (F.sigmoid(self.shared_expert_gate(hidden_states))
                                        * shared_expert_output)
            final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states


def median_seconds(fn, min_reps=5, min_seconds=2.0, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < min_reps or sum(times) < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], len(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--tokens", default="1,32,512")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", default="", help="comma list; each is tried, the best kept "
                   "(default: 1 and the CPU count)")
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--input")
    p.add_argument("--output")
    a = p.parse_args()
    if os.environ.get("EPSERVE_BENCH_ISA") == "avx2" and not hasattr(torch.backends, "cpu"):
        # torch 1.13 sends BF16 GEMMs to oneDNN by the CPU's own flags, and its oneDNN, kept
        # to AVX2 (bench_e2e.py --isa=avx2), has no BF16 GEMM: off, they take ATen's own
        # loop, as on a CPU without AVX-512.
        torch.backends.mkldnn.enabled = False

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.inference_mode():
        block = SparseMoeBlock(a.weights).to(dtype).eval()
        if a.input:
            x = torch.from_numpy(np.load(a.input)).to(dtype)
            np.save(a.output, block(x).float().numpy())
        threads = ([int(t) for t in a.threads.split(",")] if a.threads
                   else sorted({1, os.cpu_count() or 1}))
        hidden = block.cfg["hidden"]
        rng = np.random.default_rng(7)
        for tokens in [int(t) for t in a.tokens.split(",")]:
            x = torch.from_numpy(rng.uniform(-1, 1, size=(tokens, hidden)).astype(np.float32))
            x = x.to(dtype)
            best = None
            for n in threads:
                torch.set_num_threads(n)
                median, reps = median_seconds(lambda: block(x), min_seconds=a.min_seconds)
                if best is None or median < best[0]:
                    best = (median, reps, n)
            print(json.dumps({"tokens": tokens, "median_ms": best[0] * 1e3,
                              "tokens_per_s": tokens / best[0], "reps": best[1],
                              "threads": best[2], "dtype": a.dtype,
                              "torch": f"{torch.__version__}{isa()}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
