#!/usr/bin/python3
"""Weight swaps under load, one run: starts `mpirun -np 3 epserve` (1 front-end, 2 workers),
records each fixed request's answer under two weight sets (seeds 0 and 1 of a synthetic
model), then runs closed-loop clients that check every answer against both while the
weights are swapped back and forth (RepositoryModelLoad with `model` and `seed`). Prints per
swap how long it took, the resident memory of the server's processes before, at the peak
and after, the requests answered by each weight set, the failures (must be 0), and the
client latency without swaps against the latency of requests that overlapped a swap.

    PYTHONPATH=build/proto/python:client/python /usr/bin/python3 bench/e2e/weight_swap.py \\
        --build build [--model synthetic:qwen1.5-moe-a2.7b] [--layers 0] [--swaps 5] \\
        [--clients 4] [--tokens 32]
"""

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))

from bench_e2e import Cluster, base_env, log  # noqa: E402
import epserve_client  # noqa: E402


def server_rss_bytes(root_pid):
    """Resident bytes of every process in root_pid's session (mpirun, its ranks)."""
    out = subprocess.run(["ps", "-o", "rss=", "-g", str(os.getsid(root_pid))],
                         capture_output=True, text=True).stdout
    return 1024 * sum(int(v) for v in out.split())


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--model", default="synthetic:qwen1.5-moe-a2.7b")
    p.add_argument("--layers", default="0", help="served layers (--layers of epserve)")
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="rows per request")
    p.add_argument("--requests", type=int, default=8, help="distinct fixed requests")
    p.add_argument("--steady-seconds", type=float, default=5.0)
    a = p.parse_args()

    build = os.path.abspath(a.build)
    cluster = Cluster(build, base_env(build), a.model, [f"--layers={a.layers}"])
    try:
        client = epserve_client.Client(cluster.address)
        hidden = int(client.model_metadata().inputs[0].shape[-1])
        rng = np.random.default_rng(0)
        xs = [rng.uniform(-1, 1, size=(a.tokens, hidden)).astype(np.float32)
              for _ in range(a.requests)]
        answers = {}
        for seed in (1, 0):  # ends on the started weights (seed 0)
            client.load_model(a.model, seed=seed)
            answers[seed] = [client.infer(x) for x in xs]
        idle_rss = server_rss_bytes(cluster.proc.pid)

        stop = threading.Event()
        lock = threading.Lock()
        records = []  # (start, end, seed or None)
        failures = []

        def run(k):
            c = epserve_client.Client(cluster.address)
            i = k
            try:
                while not stop.is_set():
                    j = i % len(xs)
                    i += 1
                    t0 = time.time()
                    try:
                        y = c.infer(xs[j], timeout=600)
                    except epserve_client.InferError as e:
                        with lock:
                            failures.append(str(e)[:200])
                        continue
                    t1 = time.time()
                    seed = next((s for s in answers if np.array_equal(y, answers[s][j])), None)
                    with lock:
                        records.append((t0, t1, seed))
                        if seed is None:
                            failures.append(f"request {j}: an answer of neither weight set")
            finally:
                c.close()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(a.steady_seconds)
        steady_end = time.time()
        swaps = []
        peak = [idle_rss]

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], server_rss_bytes(cluster.proc.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for n in range(a.swaps):
            seed = 1 if n % 2 == 0 else 0
            before = server_rss_bytes(cluster.proc.pid)
            peak[0] = before
            t0 = time.time()
            client.load_model(a.model, seed=seed)
            t1 = time.time()
            time.sleep(1.0)
            swaps.append((t0, t1, seed, before, peak[0], server_rss_bytes(cluster.proc.pid)))
        stop.set()
        for t in threads + [sampler]:
            t.join()
        final_rss = server_rss_bytes(cluster.proc.pid)
    finally:
        cluster.stop()

    mib = 1 << 20
    print(f"model {a.model} --layers={a.layers}, 2 workers, {a.clients} clients x {a.tokens} "
          f"rows; server RSS idle {idle_rss / mib:.0f} MiB")
    print("| swap | to seed | took s | RSS before MiB | RSS peak MiB | RSS 1 s after MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, (t0, t1, seed, before, top, after) in enumerate(swaps, 1):
        print(f"| {n} | {seed} | {t1 - t0:.2f} | {before / mib:.0f} | {top / mib:.0f} | "
              f"{after / mib:.0f} |")
    steady = [1e3 * (e - s) for s, e, _ in records if e <= steady_end]
    overlapped = [1e3 * (e - s) for s, e, _ in records
                  if any(s < t1 and e > t0 for t0, t1, *_ in swaps)]
    by_seed = {s: sum(1 for *_, x in records if x == s) for s in answers}
    print(f"answers: {len(records)} ({by_seed[0]} seed 0, {by_seed[1]} seed 1), "
          f"failures {len(failures)}")
    print(f"latency without swaps: p50 {percentile(steady, 50):.1f} ms, p99 "
          f"{percentile(steady, 99):.1f} ms ({len(steady)} requests); requests that overlapped "
          f"a swap: p50 {percentile(overlapped, 50):.1f} ms, max {max(overlapped, default=0):.1f}"
          f" ms ({len(overlapped)} requests)")
    print(f"server RSS at the end {final_rss / mib:.0f} MiB (idle before the swaps "
          f"{idle_rss / mib:.0f} MiB)")
    for f in failures[:5]:
        log("failure: " + f)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
