#!/usr/bin/env python3
"""The MoE layer through the strongest CPU MoE kernels that install here (bench/e2e/baselines/:
vLLM's CPU fused MoE, kt-kernel, torch._grouped_mm and the Hugging-Face-style loop under
PyPI torch, ggml's MUL_MAT_ID), on the weights bench_e2e_dump_weights wrote. Routing and the
shared expert are the same PyTorch code for every variant (baselines/common.py); only the
routed-expert kernel differs. Run it with the interpreter of the virtual environment that
bench/install-deps.sh makes (default ~/.cache/epserve/bench-venv/bin/python).

    moe_baselines.py --weights DIR --dtype fp32|bf16 [--variants all|a,b] [--tokens 1,32,512]
                     [--threads N] [--input x.npy]

Prints one JSON object per variant and token count: {"variant", "dtype", "version",
"tokens", "median_ms", "tokens_per_s", ...}, or {"variant", "unsupported": reason}. With
--input, first checks each variant on those rows against common.reference (the same routing,
then the loop and the shared expert in FP32 on the same dtype-rounded weights and inputs): {"variant", "check_tokens", "max_rel_error", "tolerance",
"ok"}. Run it with OMP_WAIT_POLICY=PASSIVE (bench_e2e.py does).
"""

import argparse
import importlib
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import common  # noqa: E402

MODULES = ("vllm_cpu", "kt_kernel", "torch_grouped", "ggml_moe")
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def variants(dtype):
    """{name: (module, factory)} of every variant of `dtype`, in MODULES order."""
    found = {}
    for name in MODULES:
        module = importlib.import_module(f"baselines.{name}")
        for variant, (vdtype, factory) in module.VARIANTS.items():
            if vdtype == dtype:
                found[variant] = (module, factory)
    return found


def median_seconds(fn, min_reps=5, min_seconds=2.0, warmup=2, max_call_seconds=None):
    """Median of >= min_reps timed calls (and >= min_seconds in all) after `warmup` calls;
    (None, seconds) when the first call alone takes longer than max_call_seconds."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if max_call_seconds is not None and first > max_call_seconds:
        return None, first
    for _ in range(warmup - 1):
        fn()
    times = []
    while len(times) < min_reps or sum(times) < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], len(times)


def rel_error(y, ref):
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def emit(**fields):
    print(json.dumps(fields), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="fp32")
    p.add_argument("--variants", default="all", help="comma list, or all (of --dtype)")
    p.add_argument("--tokens", default="1,32,512")
    p.add_argument("--threads", default="", help="comma list; each is tried, the best kept "
                   "per token count (default: 1 and the CPU count)")
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--max-call-seconds", type=float, default=20.0,
                   help="a variant whose call at some token count takes longer (measured, or "
                   "predicted linearly from the previous count) is not timed there nor at "
                   "larger counts (torch._grouped_mm in BF16 on an AVX2 CPU: ~4 s at 32 "
                   "tokens of the qwen shape, ~67 s at 512)")
    p.add_argument("--input", help="rows [T, H] (.npy, float32) to check every variant on")
    p.add_argument("--list", action="store_true", help="print the variants of --dtype, exit")
    a = p.parse_args()

    table = variants(a.dtype)
    if a.list:
        print("\n".join(table))
        return 0
    chosen = list(table) if a.variants == "all" else a.variants.split(",")
    unknown = [v for v in chosen if v not in table]
    if unknown:
        sys.exit(f"unknown variants for {a.dtype}: {unknown} (known: {list(table)})")
    threads = ([int(t) for t in a.threads.split(",")] if a.threads
               else sorted({1, os.cpu_count() or 1}))
    dtype = common.DTYPES[a.dtype]
    with torch.inference_mode():
        w = common.Weights(a.weights, dtype)
        reference = None
        if a.input:
            x_check = torch.from_numpy(np.load(a.input)).to(dtype)
            reference = common.reference(x_check, w)
        rng = np.random.default_rng(7)
        inputs = {t: torch.from_numpy(rng.uniform(-1, 1, size=(t, w.hidden))
                                      .astype(np.float32)).to(dtype)
                  for t in (int(t) for t in a.tokens.split(","))}
        for variant in chosen:
            run_variant(variant, table[variant], w, a.dtype, threads, inputs, a.min_seconds,
                        a.max_call_seconds, x_check if a.input else None, reference)
    return 0


def run_variant(variant, module_factory, w, dtype, threads, inputs, min_seconds,
                max_call_seconds, x_check, reference):
    """Prepares the variant once per thread count (the kernels' own thread pools are sized
    at preparation), checks it against `reference` on x_check, and times it at each token
    count; emits the best thread count's median per token count."""
    module, factory = module_factory
    best, too_slow = {}, {}
    for n in threads:
        torch.set_num_threads(n)
        try:
            routed = factory(w)
            version = module.version()
        except common.Unsupported as e:
            emit(variant=variant, dtype=dtype, unsupported=str(e))
            return
        except Exception as e:  # a library that loads but fails: report it, go on
            emit(variant=variant, dtype=dtype, failed=f"{type(e).__name__}: {e}")
            return
        if reference is not None and n == threads[-1]:
            err = rel_error(common.layer(x_check, w, routed).float(), reference)
            emit(variant=variant, dtype=dtype, version=version,
                 check_tokens=x_check.shape[0], max_rel_error=err,
                 tolerance=TOLERANCE[dtype], ok=err <= TOLERANCE[dtype])
        previous = None
        for tokens, x in inputs.items():
            if previous and previous[1] * tokens / previous[0] > max_call_seconds:
                too_slow.setdefault(tokens, f"predicted {previous[1] * tokens / previous[0]:.0f}"
                                    f" s per call from {previous[0]} tokens")
                break  # larger token counts take longer still
            median, reps = median_seconds(lambda: common.layer(x, w, routed),
                                          min_seconds=min_seconds,
                                          max_call_seconds=max_call_seconds)
            if median is None:
                too_slow.setdefault(tokens, f"one call took {reps:.1f} s")
                break
            previous = (tokens, median)
            if tokens not in best or median < best[tokens][0]:
                best[tokens] = (median, reps, n)
        del routed
    for tokens, (median, reps, n) in best.items():
        emit(variant=variant, dtype=dtype, version=version, tokens=tokens,
             median_ms=median * 1e3, tokens_per_s=tokens / median, reps=reps, threads=n)
    for tokens, why in too_slow.items():
        if tokens not in best:
            emit(variant=variant, dtype=dtype, version=version, tokens=tokens,
                 too_slow=f"{why}, over --max-call-seconds; not timed here nor at larger "
                 "token counts")


if __name__ == "__main__":
    sys.exit(main())
