#!/usr/bin/python3
"""System shared memory against inline requests, same server, same run: starts
`mpirun -np 1+W epserve`, then runs epserve-load closed-loop steps alternately inline and with
--shared-memory (rounds x modes), and prints per step the tokens/s, p50 and the server's own
split: per batch, rank 0's scatter, gather and respond stages and the workers' stages, from
/metrics scraped before and after the step (epserve_stage_duration_seconds), and per request
the split epserve-load reads from ModelStatistics.

    python3 bench/e2e/shm_vs_inline.py --build build --model synthetic:tiny
    python3 bench/e2e/shm_vs_inline.py --build gpu-bundle --workers 1 \\
        --model synthetic:qwen1.5-moe-a2.7b --epserve-flags="--device=gpu --weight-dtype=bf16 \\
        --max-batch-tokens=4096" --tokens 4096 --concurrency 1,4

Standard library only (it runs from a bundle on hosts without gRPC's Python package). The
figure the system shared-memory issue names: tokens/s at saturation with --shared-memory
against inline, 4096-token BF16 requests; its target is 1.3x.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from host import host_description


def with_bundle_libs(env, build):
    """env with a bundle's lib/ (bench/gpu/make_bundle.sh: its own gRPC and friends) first on
    LD_LIBRARY_PATH, which mpirun passes on (-x); a build folder leaves it as it was."""
    env = dict(env)
    lib = os.path.join(os.path.abspath(build), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
    env.setdefault("LD_LIBRARY_PATH", "")
    return env


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Cluster:
    def __init__(self, build, env, workers, model, flags):
        self.dir = tempfile.mkdtemp(prefix="epserve-shm-bench-")
        ready = os.path.join(self.dir, "ready.json")
        cmd = ["mpirun", "-np", str(1 + workers), "--oversubscribe", "--bind-to", "none",
               "-x", "LD_LIBRARY_PATH", os.path.join(build, "server", "epserve"),
               f"--model={model}", "--seed=0", "--grpc-address=127.0.0.1:0",
               "--metrics-address=127.0.0.1:0", f"--ready-file={ready}", *flags]
        log("$ " + " ".join(cmd))
        self.log = open(os.path.join(self.dir, "log.txt"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 900
        while not os.path.exists(ready) or os.path.getsize(ready) == 0:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("epserve did not start:\n" + self.text()[-4000:])
            time.sleep(0.5)
        time.sleep(0.2)
        with open(ready) as f:
            r = json.load(f)
        self.address, self.metrics = r["grpc"], r["metrics"]

    def text(self):
        with open(self.log.name) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


HISTOGRAM = re.compile(r'^(epserve_\w+_seconds)_(sum|count)(\{.*\})? (\S+)$')


def histograms(metrics_address):
    """{(name, ((label, value), ...)): [sum_seconds, count]} of every epserve_*_seconds
    histogram on /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = HISTOGRAM.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(3) or "")))
        entry = out.setdefault((m.group(1), labels), [0.0, 0.0])
        entry[0 if m.group(2) == "sum" else 1] = float(m.group(4))
    return out


def stages(metrics_address):
    """{(stage, rank): [sum_seconds, count]} from /metrics."""
    out = {}
    for (name, labels), entry in histograms(metrics_address).items():
        if name == "epserve_stage_duration_seconds":
            d = dict(labels)
            out[(d.get("stage"), d.get("rank"))] = entry
    return out


def stage_means_ms(before, after):
    """Mean milliseconds per batch of each stage between two scrapes; workers' stages are
    averaged over the workers."""
    per = {}
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c1 > c0:
            stage, rank = key
            name = stage if rank == "0" else f"w.{stage}"
            per.setdefault(name, []).append((s1 - s0) / (c1 - c0) * 1e3)
    return {k: sum(v) / len(v) for k, v in per.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build", help="build folder or bundle")
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epserve-flags", default="", help="more epserve flags, space-separated")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="BF16")
    p.add_argument("--concurrency", default="1,2")
    p.add_argument("--duration", default="5s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--load-flags", default="",
                   help="more epserve-load flags, space-separated (e.g. --threads=16: the load "
                        "generator's threads build each request's fresh rows, and a few of them "
                        "can bound what a many-core server is measured at)")
    args = p.parse_args()
    build = os.path.abspath(args.build)
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    env = with_bundle_libs(env, build)
    env.setdefault("POCL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "epserve-pocl"))
    env.setdefault("EPSERVE_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), "epserve-kc"))
    load = os.path.join(build, "client", "epserve-load")
    cluster = Cluster(build, env, args.workers, args.model, args.epserve_flags.split())
    rows = []
    try:
        for rnd in range(1, args.rounds + 1):
            for mode in ("inline", "shared memory"):
                for c in args.concurrency.split(","):
                    before = stages(cluster.metrics)
                    cmd = [load, f"--target={cluster.address}", f"--tokens={args.tokens}",
                           f"--concurrency={c}", f"--duration={args.duration}",
                           f"--dtype={args.dtype}", "--warmup=2s", "--json", "--progress=off",
                           "--timeout=60s"]
                    if mode == "shared memory":
                        cmd.append("--shared-memory")
                    cmd += args.load_flags.split()
                    r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                       timeout=600)
                    after = stages(cluster.metrics)
                    steps = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
                    if r.returncode != 0 or not steps:
                        raise RuntimeError(f"epserve-load failed: {r.stdout}\n{r.stderr}")
                    s = steps[-1]
                    row = {"round": rnd, "mode": mode, "concurrency": int(c), "step": s,
                           "stages_ms": stage_means_ms(before, after)}
                    rows.append(row)
                    log(f"round {rnd} {mode} c={c}: {json.dumps(s)[:300]}")
    finally:
        cluster.stop()
        workers = re.findall(r"worker \d+ on [^\n]*", cluster.text())
        shutil.rmtree(cluster.dir, ignore_errors=True)

    def get(step, *keys):
        for k in keys:
            if isinstance(step, dict) and k in step:
                step = step[k]
            else:
                return float("nan")
        return step

    print(f"host: {host_description()}")
    for w in workers[:4]:
        print(f"  {w}")
    print(f"epserve {args.model} {args.epserve_flags}, {args.workers} worker(s); "
          f"epserve-load --tokens {args.tokens} --dtype {args.dtype}, {args.duration} a step")
    print()
    names = sorted({k for r in rows for k in r["stages_ms"]},
                   key=lambda k: (k.startswith("w."), k))
    split = ("queue", "compute_input", "compute_infer", "compute_output")
    print("| round | mode | clients | tokens/s | p50 ms | "
          + " | ".join(f"{n} ms/request" for n in split) + " | "
          + " | ".join(f"{n} ms/batch" for n in names) + " |")
    print("|" + "---|" * (5 + len(split) + len(names)))
    for r in rows:
        s = r["step"]
        print(f"| {r['round']} | {r['mode']} | {r['concurrency']} | "
              f"{get(s, 'tokens_per_s'):,.0f} | {get(s, 'latency_ms', 'p50'):.2f} | "
              + " | ".join(f"{get(s, 'server', n + '_ms'):.2f}" for n in split) + " | "
              + " | ".join(f"{r['stages_ms'].get(n, float('nan')):.2f}" for n in names) + " |")
    best = {}
    for r in rows:
        key = (r["round"], r["mode"])
        best[key] = max(best.get(key, 0.0), get(r["step"], "tokens_per_s"))
    print()
    for rnd in range(1, args.rounds + 1):
        inline, shm = best.get((rnd, "inline"), 0), best.get((rnd, "shared memory"), 0)
        if inline > 0:
            print(f"round {rnd}: saturation (best step) shared memory {shm:,.0f} / inline "
                  f"{inline:,.0f} tokens/s = {shm / inline:.2f}x (target 1.3x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host_description(), "workers": workers, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
