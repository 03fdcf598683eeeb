#!/usr/bin/env python3
"""Same-GPU baselines in PyTorch for the GPU benchmarks, each printed as one JSON line.

  layer:       the MoE layer as a PyTorch user writes it today: softmax top-k routing, the
               tokens permuted expert-major, each expert's SwiGLU FFN through
               torch._grouped_mm (CUTLASS's grouped GEMM), the weighted combine and the
               (gated) shared expert, BF16; timed eager and replayed from a CUDA graph; with
               the layer's weight-read bound (the bytes of the experts the batch touches plus
               the shared expert, over the read rate of torch.sum on this GPU, measured here).

    python3 bench/gpu/torch_baselines.py layer --tokens 16,128,1024,4096 [--shapes mixtral-8x7b]

  all_to_all:  NCCL's all-to-all (torch.distributed.all_to_all_single, BF16, equal splits) of
               the given bytes per rank to each peer, the baseline of the exchange between GPUs;
               run under torchrun, one process per GPU; rank 0 prints the lines.

    torchrun --nproc_per_node=2 bench/gpu/torch_baselines.py all_to_all --bytes 16777216,1048576
"""

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {  # name: (H, F, experts, top_k, shared F, normalised top-k)
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, 5632, False),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, True),
}


def weight_bytes(shape, touched):
    """BF16 weight bytes a batch routed to `touched` experts of `shape` must read: those experts'
    three matrices, the shared expert's and the router."""
    h, f, e, _, fs, _ = SHAPES[shape]
    return 2 * (touched * 3 * h * f + 3 * h * fs + h * e)


def cuda_ms(fn, reps):
    """Mean milliseconds of `fn` over `reps` calls after warm-up, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def read_rate_bytes_per_s():
    """Bytes per second torch.sum reads from a 1 GiB BF16 tensor on this GPU."""
    x = torch.ones(1 << 29, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: x.sum(), 20)
    return x.numel() * 2 / (ms / 1e3)


class GroupedMmLayer:
    def __init__(self, shape, seed=0):
        h, f, e, k, fs, self.norm = SHAPES[shape]
        self.shape = shape
        self.h, self.f, self.e, self.k, self.fs = h, f, e, k, fs
        g = torch.Generator(device="cuda").manual_seed(seed)

        def w(*dims):
            return (torch.randn(*dims, device="cuda", dtype=torch.bfloat16, generator=g)
                    / dims[-2] ** 0.5)

        self.router = w(h, e)
        self.gate_up = w(e, h, 2 * f)
        self.down = w(e, f, h)
        if fs:
            self.shared_gate_up, self.shared_down = w(h, 2 * fs), w(fs, h)
            self.shared_gate = w(h, 1)

    def __call__(self, x):
        probs = torch.softmax((x @ self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, device="cuda", dtype=torch.int64)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync: graph-capturable
        ends = counts.cumsum(0).to(torch.int32)
        token = order // self.k
        gu = torch._grouped_mm(x[token], self.gate_up, offs=ends)
        y = torch._grouped_mm(F.silu(gu[:, :self.f]) * gu[:, self.f:], self.down, offs=ends)
        out = torch.zeros(x.shape, device="cuda", dtype=torch.float32)
        out.index_add_(0, token, y.float() * weights.flatten()[order, None])
        if self.fs:
            s = x @ self.shared_gate_up
            shared = (F.silu(s[:, :self.fs]) * s[:, self.fs:]) @ self.shared_down
            out += torch.sigmoid((x @ self.shared_gate).float()) * shared.float()
        return out.to(torch.bfloat16), experts

    def bytes_read(self, experts):
        """Weight bytes a batch routed to `experts` must read (BF16)."""
        return weight_bytes(self.shape, int(torch.unique(experts).numel()))


def layer_figures(shapes, token_counts, reps=50, rate=None):
    """One dict per (shape, tokens): the grouped_mm layer eager and from a CUDA graph, and the
    layer's weight-read bound at `rate` bytes/s (measured here when None)."""
    rate = rate or read_rate_bytes_per_s()
    for shape in shapes:
        model = GroupedMmLayer(shape)
        for tokens in token_counts:
            x = torch.randn(tokens, model.h, device="cuda", dtype=torch.bfloat16)
            _, experts = model(x)
            eager = cuda_ms(lambda: model(x), reps)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up on a side stream, as capture wants
                model(x)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                model(x)
            replay = cuda_ms(graph.replay, reps)
            nbytes = model.bytes_read(experts)
            yield {"baseline": "grouped_mm_layer", "shape": shape, "tokens": tokens,
                   "eager_ms": round(eager, 4), "graph_ms": round(replay, 4),
                   "weight_bytes": nbytes, "read_GBps": round(rate / 1e9, 1),
                   "bound_ms": round(nbytes / rate * 1e3, 4),
                   "gpu": torch.cuda.get_device_name(0)}
        del model
        torch.cuda.empty_cache()


def layer(args):
    for figures in layer_figures(args.shapes.split(","),
                                 [int(t) for t in args.tokens.split(",")], args.reps):
        print(json.dumps(figures), flush=True)


def all_to_all(args):
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    for peer_bytes in [int(b) for b in args.bytes.split(",")]:
        # Equal splits: each rank gets numel / world elements, (world - 1) parts go to peers.
        per_rank = max(1, peer_bytes // 2)
        x = torch.randn(per_rank * world, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        for _ in range(5):
            dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            dist.all_to_all_single(y, x)
        end.record()
        end.synchronize()
        ms = torch.tensor([start.elapsed_time(end) / args.reps], device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank, as bench_device_exchange
        moved = per_rank * 2 * (world - 1)
        if rank == 0:
            print(json.dumps({"baseline": "nccl_all_to_all", "ranks": world,
                              "bytes_per_rank_to_peers": moved, "ms": round(ms.item(), 5),
                              "gb_per_s": round(moved / (ms.item() / 1e3) / 1e9, 1),
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "gpu": torch.cuda.get_device_name(0)}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("layer")
    lp.add_argument("--shapes", default=",".join(SHAPES))
    lp.add_argument("--tokens", default="16,128,1024,4096")
    lp.add_argument("--reps", type=int, default=50)
    ap = sub.add_parser("all_to_all")
    ap.add_argument("--bytes", default="16777216")
    ap.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    {"layer": layer, "all_to_all": all_to_all}[args.what](args)


if __name__ == "__main__":
    main()
