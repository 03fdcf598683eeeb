#!/usr/bin/python3
"""A decode-sized request's latency through the service against the in-process layer, same
run: one client at a time sends T-token requests through system shared memory (epserve-load
--concurrency=1 --shared-memory), and the service's p50 less the resident in-process layer's
median (bench_e2e_inprocess) is what serving adds. Each round starts the service once with
the baseline flags (by default --direct-batch-tokens=0: every request passes the batcher's
thread hand-offs) and once without, alternately, and prints per step p50, p99 and the means
of rank 0's and the workers' stages from /metrics.

    python3 bench/e2e/decode_latency.py --build build --model synthetic:tiny
    python3 bench/e2e/decode_latency.py --build gpu-bundle --workers 1 \\
        --model synthetic:qwen1.5-moe-a2.7b --epserve-flags="--device=gpu --weight-dtype=bf16"

Issue 40's target for the service: p50 <= the resident in-process layer + 0.25 ms at 16 and
128 tokens. The same run times a bare gRPC echo of one small request (bench_frontend): the
floor any gRPC service pays per request on the host, and the last column what epserve adds
beyond the layer and that floor. Standard library only (it runs from a bundle).
"""

import argparse
import json
import os
import subprocess
import sys

from host import host_description
from shm_vs_inline import Cluster, histograms, log, with_bundle_libs

def means(metrics_address):
    """{histogram name with its labels but `code`/`model`: [sum, count]} of every *_seconds
    histogram on /metrics (summed over the labels left out)."""
    out = {}
    for (name, labels), (total, count) in histograms(metrics_address).items():
        keep = ",".join(f"{k}={v}" for k, v in labels if k not in ("model", "code"))
        entry = out.setdefault(name + (f"{{{keep}}}" if keep else ""), [0.0, 0.0])
        entry[0] += total
        entry[1] += count
    return out


def mean_ms(before, after):
    out = {}
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c1 > c0:
            out[key.replace("epserve_", "").replace("_seconds", "")] = (s1 - s0) / (c1 - c0) * 1e3
    return out


def inprocess(args, env, tokens):
    cmd = [os.path.join(args.build, "bench", "e2e", "bench_e2e_inprocess"),
           f"--model={args.model}", "--tokens=" + ",".join(map(str, tokens)),
           "--check-tokens=0", "--min-seconds=1", *args.inprocess_flags.split()]
    log("$ " + " ".join(cmd))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "tokens" in d:
                rows[d["tokens"]] = d.get("resident_median_ms") or d["median_ms"]
    return rows


def grpc_floor(args, env):
    """p50 ms of one client's ModelInfer over localhost against a bare gRPC echo, and against
    epserve's front-end over an executor that copies rows back (bench_frontend, 1 token of
    H 2048 inline: 8 KiB each way, more than a shared-memory request's message): what one
    gRPC round trip costs on this host before any layer runs."""
    exe = os.path.join(args.build, "bench", "frontend", "bench_frontend")
    if not os.path.exists(exe):
        return None
    out = subprocess.run([exe, "--tokens=1", "--clients=1", "--seconds=3"], env=env,
                         capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == "1":
            return {"echo_p50": float(cells[2]) / 1e3, "front_end_p50": float(cells[5]) / 1e3}
    log("bench_frontend printed no result: " + out.stderr[-2000:])
    return None


def one_client(args, env, address, tokens):
    cmd = [os.path.join(args.build, "client", "epserve-load"), f"--target={address}",
           f"--tokens={tokens}", "--concurrency=1", f"--duration={args.duration}",
           "--warmup=1s", "--shared-memory=true", "--json", "--progress=off"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            lat = d.get("latency_ms") or {}
            return {"p50": lat.get("p50"), "p99": lat.get("p99"), "ok": d.get("ok"),
                    "errors": d.get("errors")}
    raise RuntimeError("epserve-load printed no result:\n" + out.stderr[-3000:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build", help="build folder or bundle")
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--tokens", default="16,128")
    p.add_argument("--epserve-flags", default="--device=cpu", help="flags of both variants")
    p.add_argument("--baseline-flags", default="--direct-batch-tokens=0")
    p.add_argument("--baseline-build", default="",
                   help="run the baseline from this build instead (e.g. the commit before)")
    p.add_argument("--inprocess-flags", default="--device=cpu",
                   help="bench_e2e_inprocess flags (its device and weight dtype)")
    p.add_argument("--duration", default="4s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    base_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env = with_bundle_libs(base_env, args.build)
    print(f"host: {host_description()}")
    layer = inprocess(args, env, tokens)
    floor = grpc_floor(args, env)
    base = args.baseline_build or args.build
    variants = [(f"baseline {args.baseline_build} {args.baseline_flags}".replace("  ", " "),
                 base, args.baseline_flags.split()), ("default", args.build, [])]
    results = []
    for r in range(args.rounds):
        for name, build, extra in variants:
            c = Cluster(build, with_bundle_libs(base_env, build), args.workers, args.model,
                        args.epserve_flags.split() + extra)
            try:
                for t in tokens:
                    before = means(c.metrics)
                    res = one_client(args, env, c.address, t)
                    res.update(round=r, variant=name, tokens=t, layer_ms=layer.get(t),
                               stages_ms=mean_ms(before, means(c.metrics)))
                    results.append(res)
                    log(json.dumps(res))
            finally:
                c.stop()
    print(f"model {args.model}, {args.workers} worker(s), flags: {args.epserve_flags}; "
          f"in-process layer (resident) from bench_e2e_inprocess {args.inprocess_flags}")
    echo = floor["echo_p50"] if floor else None
    if floor:
        print(f"gRPC floor, same run (bench_frontend, 1 client, 1 token inline): bare echo p50 "
              f"{floor['echo_p50']:.3f} ms, epserve's front-end over a copy executor "
              f"{floor['front_end_p50']:.3f} ms")
    print("| tokens | variant | round | p50 ms | p99 ms | in-process ms | p50 - in-process "
          "| p50 - in-process - echo |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for res in results:
        lay = res["layer_ms"] or 0
        beyond = f"{res['p50'] - lay - echo:+.3f}" if echo is not None else "-"
        print(f"| {res['tokens']} | {res['variant']} | {res['round']} | {res['p50']:.3f} | "
              f"{res['p99']:.3f} | {lay:.3f} | {res['p50'] - lay:+.3f} | {beyond} |")
    print("\nmeans per request or batch (ms), last round:")
    for res in results[-len(tokens) * len(variants):]:
        st = " ".join(f"{k} {v:.3f}" for k, v in sorted(res["stages_ms"].items()))
        print(f"  {res['tokens']} tokens, {res['variant']}: {st}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host_description(), "grpc_floor_ms": floor, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
