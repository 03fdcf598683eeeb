#!/usr/bin/python3
"""Cold start against steady state, one run: starts `mpirun -np 3 epserve` with empty kernel
and PoCL caches (so every program is built, and the FFN blocking tuned, during this start),
times the start until the ready file, then sends requests one at a time from one client and
prints the first request's latency beside the p50 of the following ones (the steady state of
the same server). Then it does the same with empty caches again but the blocking the first
start chose forced (--ffn-blocking: the same programs built, nothing timed), so that the
difference is what tuning adds to a cold start, and once more with the caches the first start
filled (a warm start).

    PYTHONPATH=build/proto/python:client/python /usr/bin/python3 bench/e2e/cold_start.py \\
        --build build [--model synthetic:qwen1.5-moe-a2.7b] [--tokens 16] [--requests 30]

Target (issue: warm before ready): first request within 1.2x the steady-state p50.
"""

import argparse
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))

from bench_e2e import Cluster, base_env, log  # noqa: E402
import epserve_client  # noqa: E402


def one_start(build, env, model, tokens, requests, extra):
    t0 = time.time()
    cluster = Cluster(build, env, model, extra)
    start_s = time.time() - t0
    try:
        client = epserve_client.Client(cluster.address)
        rng = np.random.default_rng(0)
        hidden = int(client.model_metadata().inputs[0].shape[-1])
        latencies = []
        for _ in range(requests):
            x = rng.standard_normal((tokens, hidden), dtype=np.float32)
            t = time.perf_counter()
            client.infer(x)
            latencies.append((time.perf_counter() - t) * 1e3)
        client.close()
        with open(cluster.log.name) as f:
            startup = [line.strip() for line in f if "FFN blocking" in line]
    finally:
        cluster.stop()
    return start_s, latencies, startup


def chosen_blockings(startup):
    """The blockings the workers' startup lines name as tuned now or read from the cache, in
    order ("vec=16 rows=12 prefetch=64 chunk=192", "dot")."""
    # Each choice: a plan ("rows 1: <form>; 2-8: <form>; ...") or one form, then how it came.
    found = re.findall(r"(?:FFN blocking: | \| )(?:rows )?(.+?) \((?:tuned now|cache)",
                       " ".join(startup))
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--model", default="synthetic:qwen1.5-moe-a2.7b")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--extra", default="", help="more epserve flags, space-separated")
    a = p.parse_args()
    caches = tempfile.mkdtemp(prefix="epserve-cold-")
    env = dict(base_env(a.build), EPSERVE_KERNEL_CACHE=os.path.join(caches, "kernels"),
               POCL_CACHE_DIR=os.path.join(caches, "pocl"))
    load = os.getloadavg()
    print(f"model {a.model}, {a.tokens} tokens per request, 1 client, {a.requests} requests "
          f"per start; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before")
    print("\n| start | start to ready s | first request ms | p50 of the rest ms | first / p50 |")
    print("|---|---:|---:|---:|---:|")
    forced_caches = tempfile.mkdtemp(prefix="epserve-cold-forced-")
    forced_env = dict(env, EPSERVE_KERNEL_CACHE=os.path.join(forced_caches, "kernels"),
                      POCL_CACHE_DIR=os.path.join(forced_caches, "pocl"))
    starts = {}
    try:
        for key, label in (("cold", "cold (empty caches, blocking tuned)"),
                           ("forced", "cold (empty caches, blocking forced to the choice)"),
                           ("warm", "warm (caches of the first start)")):
            extra = a.extra.split()
            if key == "forced":
                choices = chosen_blockings(starts["cold"][2])
                if not choices:
                    log("   no tuned choice in the first start's log: no forced start")
                    continue
                if len(set(choices)) > 1:
                    log(f"   the shapes chose {sorted(set(choices))}; forcing the first")
                extra.append(f"--ffn-blocking={choices[0]}")
            start_s, lat, startup = one_start(a.build, forced_env if key == "forced" else env,
                                              a.model, a.tokens, a.requests, extra)
            starts[key] = (start_s, lat, startup)
            p50 = float(np.percentile(lat[1:], 50))
            print(f"| {label} | {start_s:.1f} | {lat[0]:.1f} | {p50:.1f} | {lat[0] / p50:.2f} |")
            for line in startup:
                log("   " + line)
        if "forced" in starts:
            print(f"\ntuning added {starts['cold'][0] - starts['forced'][0]:.1f} s to the cold "
                  f"start ({starts['cold'][0]:.1f} against {starts['forced'][0]:.1f} s)")
    finally:
        shutil.rmtree(caches, ignore_errors=True)
        shutil.rmtree(forced_caches, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} after")


if __name__ == "__main__":
    main()
