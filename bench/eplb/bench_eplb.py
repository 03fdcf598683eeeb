#!/usr/bin/python3
"""Expert load balancing benchmark: the service (1 front-end + W workers on this machine,
driven by epserve-load) on skewed expert load, with EPLB off (contiguous placement), static
(--redundant-experts copies placed by the load profile the EPLB-off run recorded,
GET /eplb/profile) and online (the same copies, placed uniformly at start, rebalanced while
serving every --eplb-interval batches), same run, same load. Per run: tokens/s, p50/p99 latency and the workers'
balancedness over the run (mean / max of epserve_worker_pairs_total), beside the bound EPLB
could reach on this load (1 / the EPLB-off balancedness: the slowest worker's share of the
pairs sets the pace when a batch's cost follows its pairs).

    /usr/bin/python3 bench/eplb/bench_eplb.py --build build [--workers 2,4] \\
        [--loads uniform,zipf:1.0,hot:4:0.3] [--duration 15s] [--weight-dtype bf16]

Each run's first --warmup seconds (in which the online run's first rebalance happens) are
left out of its figures; the worker pairs (hence balancedness) count them. With --repeat N
the three modes run N times in turn (off, static, online, off, ...) and each row gives the
median tokens/s and the median of the per-repeat ratios to off: a 2-core machine drifts by
10-20% from one run to the next.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "e2e"))
from bench_e2e import Cluster, base_env, log  # noqa: E402


def machine():
    model, flags = None, set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    model = model or platform.processor() or "unknown CPU"
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({os.cpu_count()} cores; {' '.join(isa)})"


def get(cluster, path):
    with urllib.request.urlopen(f"http://{cluster.metrics}{path}", timeout=30) as r:
        return r.read().decode()


def worker_pairs(metrics_text):
    pairs = {}
    for m in re.finditer(r'^epserve_worker_pairs_total\{layer="(\d+)",worker="(\d+)"\} (\S+)$',
                         metrics_text, re.M):
        pairs[int(m.group(2))] = pairs.get(int(m.group(2)), 0.0) + float(m.group(3))
    return [pairs[w] for w in sorted(pairs)]


def balancedness(pairs):
    return (sum(pairs) / len(pairs)) / max(pairs) if pairs and max(pairs) > 0 else 1.0


def run_load(a, env, cluster, skew):
    cmd = [os.path.join(a.build, "client", "epserve-load"), f"--target={cluster.address}",
           f"--tokens={a.tokens}", f"--concurrency={a.concurrency}", f"--duration={a.duration}",
           f"--warmup={a.warmup}", "--json", "--progress=off", f"--expert-skew={skew}",
           f"--skew-model={a.model}", f"--skew-seed={a.skew_seed}", "--timeout=60s"]
    log("  $ " + " ".join(cmd))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"epserve-load failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    steps = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return steps[-1]


def one(a, env, workers, skew, extra):
    args = [f"--weight-dtype={a.weight_dtype}", f"--max-batch-tokens={a.max_batch_tokens}",
            *extra]
    cluster = Cluster(a.build, env, a.model, args, workers=workers,
                      worker_threads=a.worker_threads)
    try:
        step = run_load(a, env, cluster, skew)
        metrics = get(cluster, "/metrics")
        pairs = worker_pairs(metrics)
        profile = get(cluster, "/eplb/profile")
        placement = [l.strip() for l in cluster.text().splitlines() if "placement of layer" in l]
    finally:
        cluster.stop()
    failed = step["requests"] - step["ok"]
    rebalances = re.search(r'^epserve_eplb_rebalances_total\{outcome="done"\} (\S+)$', metrics,
                           re.M)
    return {"rebalances": int(float(rebalances.group(1))) if rebalances else 0,"tokens_per_s": step["tokens_per_s"], "p50": step["latency_ms"]["p50"],
            "p99": step["latency_ms"]["p99"], "failed": failed, "pairs": pairs,
            "balancedness": balancedness(pairs), "profile": profile, "placement": placement}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", required=True)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--loads", default="uniform,zipf:1.0,hot:4:0.3")
    p.add_argument("--model", default="synthetic:qwen1.5-moe-a2.7b")
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--tokens", type=int, default=64, help="token rows per request")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--redundant-per-worker", type=int, default=2,
                   help="--redundant-experts = this x W")
    p.add_argument("--duration", default="15s")
    p.add_argument("--warmup", default="8s")
    p.add_argument("--eplb-interval", type=int, default=8,
                   help="the online run's --eplb-interval (batches)")
    p.add_argument("--skew-seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--worker-threads", type=int, default=1,
                   help="PoCL threads per worker (POCL_MAX_PTHREAD_COUNT)")
    a = p.parse_args()
    a.build = os.path.abspath(a.build)
    env = base_env(a.build)
    print(f"# machine: {machine()}")
    print(f"# model {a.model}, {a.weight_dtype} weights, {a.tokens} tokens/request, "
          f"{a.concurrency} clients, --max-batch-tokens={a.max_batch_tokens}, {a.duration} "
          f"per run, POCL_MAX_PTHREAD_COUNT={a.worker_threads} per worker; skew ranks permuted by seed "
          f"{a.skew_seed}; warmup {a.warmup}; online: --eplb-interval={a.eplb_interval}")
    print("| workers | load | EPLB | tokens/s (each run) | p50 ms | p99 ms | failed | "
          "worker pairs | balancedness | vs off (each run) | bound (1 / off balancedness) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    profile_dir = tempfile.mkdtemp(prefix="epserve-eplb-profile-")
    try:
        for workers in [int(w) for w in a.workers.split(",")]:
            for skew in a.loads.split(","):
                redundant = a.redundant_per_worker * workers
                path = os.path.join(profile_dir, f"w{workers}-{skew.replace(':', '_')}.json")
                runs = {"off": [], "static": [], "online": []}
                for _ in range(a.repeat):
                    off = one(a, env, workers, skew, [])
                    runs["off"].append(off)
                    if not os.path.exists(path):  # the first EPLB-off run's profile
                        with open(path, "w") as f:
                            f.write(off["profile"])
                    runs["static"].append(one(
                        a, env, workers, skew,
                        [f"--redundant-experts={redundant}", f"--eplb-profile={path}"]))
                    runs["online"].append(one(
                        a, env, workers, skew,
                        [f"--redundant-experts={redundant}", f"--eplb-interval={a.eplb_interval}"]))
                bound = 1.0 / statistics.median(r["balancedness"] for r in runs["off"])
                for mode in ("off", "static", "online"):
                    rs = runs[mode]
                    name = mode if mode == "off" else f"{mode}, {redundant} copies"
                    if mode == "online":
                        name += f", {'/'.join(str(r['rebalances']) for r in rs)} rebalances"
                    tps = [r["tokens_per_s"] for r in rs]
                    ratios = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(rs, runs["off"])]
                    med = lambda key: statistics.median(r[key] for r in rs)
                    pairs = rs[len(rs) // 2]["pairs"]
                    print(f"| {workers} | {skew} | {name} | {statistics.median(tps):.0f} "
                          f"({'/'.join(f'{t:.0f}' for t in tps)}) | {med('p50'):.1f} | "
                          f"{med('p99'):.1f} | {sum(r['failed'] for r in rs)} | "
                          f"{' / '.join(f'{x:.0f}' for x in pairs)} | "
                          f"{med('balancedness'):.3f} | {statistics.median(ratios):.2f}x "
                          f"({'/'.join(f'{x:.2f}' for x in ratios)}) | {bound:.2f}x |")
                for line in runs["static"][0]["placement"][:1]:
                    log("  " + line)
                sys.stdout.flush()
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
