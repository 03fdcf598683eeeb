#!/usr/bin/python3
"""End-to-end benchmark: epserve (1 front-end + 2 workers on this machine, driven by
epserve-load over gRPC) against the same MoE layer (a) computed in-process by epserve's
kernels alone, (b) in PyTorch on the CPU, Hugging Face's Qwen2-MoE way, and (c) through the
strongest CPU MoE kernels that install here (moe_baselines.py: vLLM's CPU fused MoE,
kt-kernel, torch._grouped_mm, ggml's MUL_MAT_ID), on the same weights, all in one run. Prints
the table and the ratios against the targets.

    PYTHONPATH=build/proto/python:client/python /usr/bin/python3 bench/e2e/bench_e2e.py \\
        --build build [--shapes qwen1.5-moe-a2.7b,olmoe-1b-7b] [--duration 8s] \\
        [--baselines-python ~/.cache/epserve/bench-venv/bin/python | --no-baselines]

(c) runs under the interpreter of the virtual environment bench/install-deps.sh makes, one
subprocess per variant; without that environment the table says so and (c) is skipped.

--isa=avx2 runs every part on code for AVX2 and FMA only, on a host that has more (an AVX-512
one standing in for an AVX2-only CPU): PoCL builds epserve's kernels for Haswell, and each
library is told to keep to AVX2 by its own switch (ISA_ENV below: ATen's CPU capability,
oneDNN's and MKL's instruction sets, OpenBLAS's core type, kt-kernel's CPU variant; vLLM's
AVX2 kernel library and routing in FP32 as on a CPU without BF16 dot products through
EPSERVE_BENCH_ISA, baselines/common.py). Caches go to folders of their own. The table's first
line names the host and the code.

Each part runs alone (the cluster is stopped while the others run). Before each shape it
waits (up to --load-wait seconds, polling every 20 s) for the 1-minute load average to drop
below --max-load, and records the load it started at. PyTorch runs with
OMP_WAIT_POLICY=PASSIVE and without OPENBLAS_CORETYPE, at its best thread count.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from host import cpu_model_and_flags, host_description

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

TARGETS = {"service_vs_inprocess": 0.85, "one_token_fp32": 2.0, "one_token_bf16": 3.5,
           "saturation": 1.5, "vs_fastest_baseline": 1.0}
# Token counts the CPU MoE baselines run at (each compared with the in-process layer there).
BASELINE_TOKENS = (1, 32, 512)
DEFAULT_VENV = os.environ.get("EPSERVE_BENCH_VENV",
                              os.path.expanduser("~/.cache/epserve/bench-venv"))
# What --isa=avx2 sets: each library's own switch to AVX2 and FMA code.
ISA_ENV = {"avx2": {
    "POCL_LLVM_CPU_NAME": "haswell", "POCL_KERNELLIB_NAME": "avx2",  # epserve's kernels
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",  # oneDNN (PyTorch's BF16 GEMMs)
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL (PyTorch's FP32 GEMMs)
    "OPENBLAS_CORETYPE": "Haswell",  # OpenBLAS (Debian's PyTorch)
    "KT_KERNEL_CPU_VARIANT": "avx2",  # kt-kernel
    "EPSERVE_BENCH_ISA": "avx2",  # the baselines' CPU flags (vLLM's library, routing dtype)
}}
# The in-process bound's batch sizes; the service's throughput configuration uses the largest.
INPROCESS_BATCHES = (1, 32, 256, 512)
THROUGHPUT_BATCH = INPROCESS_BATCHES[-1]


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def wait_for_quiet(max_load, wait_s):
    deadline = time.time() + wait_s
    while True:
        load = load1()
        if load < max_load or time.time() >= deadline:
            return load
        log(f"  load {load:.2f} >= {max_load}; waiting")
        time.sleep(20)


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def base_env(build, isa="native"):
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    # Beside the build unless the caller names other folders (a read-only build).
    suffix = "" if isa == "native" else f"-{isa}"
    env.setdefault("POCL_CACHE_DIR", os.path.join(build, f"pocl-cache{suffix}"))
    env.setdefault("EPSERVE_KERNEL_CACHE", os.path.join(build, f"kernel-cache{suffix}"))
    env.pop("OPENBLAS_CORETYPE", None)
    env.update(ISA_ENV.get(isa, {}))
    return env


def host_line(isa):
    """The CPU, its vector extensions and the code the run used."""
    code = ("each part's widest code for this CPU" if isa == "native" else
            "AVX2 and FMA code only (--isa=avx2: " +
            " ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items()) + ")")
    return f"Host: {host_description()}; code: {code}"


def run(cmd, env, timeout=3600):
    log("  $ " + " ".join(cmd))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


class Cluster:
    """mpirun -np 1+W epserve (rank 0 front-end, W workers, 2 by default, each with
    `worker_threads` PoCL threads), port 0, ready file; `address` and `metrics` once ready."""

    def __init__(self, build, env, model, extra=(), workers=2, worker_threads=1):
        self.dir = tempfile.mkdtemp(prefix="epserve-bench-")
        ready = os.path.join(self.dir, "ready.json")
        cmd = ["mpirun", "-np", str(1 + workers), "--oversubscribe", "--bind-to", "none",
               os.path.join(build, "server", "epserve"), f"--model={model}", "--seed=0",
               "--grpc-address=127.0.0.1:0", "--metrics-address=127.0.0.1:0",
               f"--ready-file={ready}", *extra]
        log("  $ " + " ".join(cmd))
        env = dict(env, POCL_MAX_PTHREAD_COUNT=str(worker_threads))
        self.log = open(os.path.join(self.dir, "log.txt"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 600
        while not os.path.exists(ready) or os.path.getsize(ready) == 0:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("epserve did not start:\n" + open(self.log.name).read())
            time.sleep(0.5)
        time.sleep(0.2)
        with open(ready) as f:
            r = json.load(f)
        self.address, self.metrics = r["grpc"], r["metrics"]

    def text(self):
        """Everything the job printed so far."""
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
        shutil.rmtree(self.dir, ignore_errors=True)


def rel_error(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def service_part(build, env, shape, x, duration, saturation_duration, weight_dtype):
    """Starts the cluster, checks one answer, runs the load steps; returns the results."""
    import epserve_client
    extra = [f"--weight-dtype={weight_dtype}"] if weight_dtype != "fp32" else []
    cluster = Cluster(build, env, f"synthetic:{shape}", extra)
    try:
        y = epserve_client.Client(cluster.address).infer(x)
        load = os.path.join(build, "client", "epserve-load")
        steps = []
        for tokens in (1, 32):
            out = run([load, f"--target={cluster.address}", f"--tokens={tokens}",
                       "--concurrency=1,16", f"--duration={duration}", "--warmup=2s",
                       "--json", "--progress=off"], env)
            for step in json_lines(out):
                step["tokens_per_request"] = tokens
                step["server_flags"] = ""
                steps.append(step)
    finally:
        cluster.stop()
    # Throughput configuration: batches as large as the in-process bound's largest, and
    # enough clients to keep two of them in flight.
    flags = [f"--max-batch-tokens={THROUGHPUT_BATCH}"]
    cluster = Cluster(build, env, f"synthetic:{shape}", extra + flags)
    try:
        tokens = 32
        out = run([load, f"--target={cluster.address}", f"--tokens={tokens}",
                   f"--concurrency={2 * THROUGHPUT_BATCH // tokens}",
                   f"--duration={saturation_duration}",
                   "--warmup=2s", "--json", "--progress=off"], env)
        for step in json_lines(out):
            step["tokens_per_request"] = tokens
            step["server_flags"] = " ".join(flags)
            steps.append(step)
    finally:
        cluster.stop()
    return {"output": y, "steps": steps}


def torch_part(env, weights, dtype, x_path, y_path, tokens):
    env = dict(env, OMP_WAIT_POLICY="PASSIVE")
    cmd = ["/usr/bin/python3", os.path.join(HERE, "moe_torch.py"), f"--weights={weights}",
           f"--tokens={tokens}", f"--dtype={dtype}", f"--input={x_path}", f"--output={y_path}"]
    rows = json_lines(run(cmd, env))
    return {r["tokens"]: r for r in rows}, np.load(y_path)


def baselines_part(env, python, weights, dtype, x_path):
    """Each variant of `dtype` in moe_baselines.py, in a subprocess of its own (a library
    that crashes or exhausts memory takes only its own row with it). Returns
    {variant: {"rows": {tokens: row}, "check": row, "unsupported" or "failed": reason}}."""
    env = dict(env, OMP_WAIT_POLICY="PASSIVE")
    script = os.path.join(HERE, "moe_baselines.py")
    names = run([python, script, f"--weights={weights}", f"--dtype={dtype}", "--list"], env)
    out = {}
    for variant in names.split():
        cmd = [python, script, f"--weights={weights}", f"--dtype={dtype}",
               f"--variants={variant}", f"--tokens={','.join(map(str, BASELINE_TOKENS))}",
               f"--input={x_path}"]
        log("  $ " + " ".join(cmd))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        entry = {"rows": {}}
        for row in json_lines(r.stdout):
            if "unsupported" in row or "failed" in row:
                entry.update({k: row[k] for k in ("unsupported", "failed") if k in row})
            elif "check_tokens" in row:
                entry["check"] = row
            elif "too_slow" in row:
                entry.setdefault("too_slow", {})[row["tokens"]] = row["too_slow"]
            else:
                entry["rows"][row["tokens"]] = row
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            entry["failed"] = f"exit {r.returncode}: {tail}"
        out[variant] = entry
    return out


def inprocess_part(build, env, shape, dtype, tokens):
    env = dict(env, POCL_MAX_PTHREAD_COUNT=str(os.cpu_count() or 2))
    cmd = [os.path.join(build, "bench", "e2e", "bench_e2e_inprocess"),
           f"--model=synthetic:{shape}", "--seed=0", f"--tokens={tokens}",
           f"--weight-dtype={dtype}", "--read-bandwidth"]
    rows = json_lines(run(cmd, env))
    check = [r for r in rows if "check_tokens" in r][0]
    check["floor"] = [r for r in rows if "read_gb_per_s" in r][0]
    return {r["tokens"]: r for r in rows if "tokens" in r}, check


def bench_shape(a, env, shape, dtypes):
    log(f"== {shape}")
    result = {"shape": shape, "load_before": wait_for_quiet(a.max_load, a.load_wait)}
    log(f"  load {result['load_before']:.2f}")
    tmp = tempfile.mkdtemp(prefix=f"epserve-bench-{shape}-")
    try:
        weights = os.path.join(tmp, "weights")
        run([os.path.join(a.build, "bench", "e2e", "bench_e2e_dump_weights"),
             f"--model=synthetic:{shape}", "--seed=0", f"--out={weights}"], env)
        with open(os.path.join(weights, "config.json")) as f:
            hidden = json.load(f)["hidden"]
        x = np.random.default_rng(3).uniform(-1, 1, size=(16, hidden)).astype(np.float32)
        x_path, y_path = os.path.join(tmp, "x.npy"), os.path.join(tmp, "y_torch.npy")
        np.save(x_path, x)
        for dtype in dtypes:
            r = {}
            batches = ",".join(map(str, INPROCESS_BATCHES))
            r["inprocess"], r["inprocess_check"] = inprocess_part(a.build, env, shape, dtype,
                                                                  batches)
            r["torch"], y_torch = torch_part(env, weights, dtype, x_path, y_path,
                                             ",".join(map(str, BASELINE_TOKENS)))
            if a.baselines_python:
                r["baselines"] = baselines_part(env, a.baselines_python, weights, dtype, x_path)
            svc = service_part(a.build, env, shape, x, a.duration, a.saturation_duration, dtype)
            r["service_steps"] = svc["steps"]
            r["service_vs_torch_rel_error"] = rel_error(svc["output"], y_torch)
            result[dtype] = r
        result["load_after"] = load1()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def baseline_lines(dtype, r):
    """Table rows of the CPU MoE baselines, a line of their correctness checks, and
    {tokens: (tokens_per_s, variant)} of the fastest at each token count."""
    rows, checks, fastest = [], [], {}
    for variant, e in r.get("baselines", {}).items():
        why = e.get("unsupported") or e.get("failed")
        if why and not e["rows"]:
            kind = "no path on this machine" if "unsupported" in e else "failed"
            rows.append(f"| {dtype} | {variant} | | | {kind}: {why} | | | | | |")
            continue
        if "check" in e:
            c = e["check"]
            checks.append(f"{variant} {c['max_rel_error']:.2e}"
                          + ("" if c["ok"] else f" (ABOVE {c['tolerance']:.0e})"))
        for t, v in sorted(e["rows"].items()):
            rows.append(f"| {dtype} | {variant} ({v['version']}, {v['threads']} thr) | {t} "
                        f"(batch) | 1 | {v['tokens_per_s']:.1f} | {v['median_ms']:.2f} "
                        f"(median) | | | | |")
            if e.get("check", {}).get("ok", True) and (
                    t not in fastest or v["tokens_per_s"] > fastest[t][0]):
                fastest[t] = (v["tokens_per_s"], variant)
        for t, why in sorted(e.get("too_slow", {}).items()):
            rows.append(f"| {dtype} | {variant} | {t} (batch) | 1 | not timed: {why} | | | | | |")
    check = ""
    if checks:
        check = (f"\n{dtype}: CPU MoE baselines on the same 16 rows vs the same routing, then "
                 f"the loop and shared expert in FP32 on the same (dtype-rounded) weights: max "
                 f"rel diff " + "; ".join(checks) + "\n")
    return rows, check, fastest


def step(steps, concurrency, tokens):
    for s in steps:
        if (s["concurrency"] == concurrency and s["tokens_per_request"] == tokens
                and not s["server_flags"]):
            return s
    return None


def summarize(results, isa):
    lines = [host_line(isa)]
    ratios = []
    for res in results:
        shape = res["shape"]
        lines.append(f"\n### {shape} (load average {res['load_before']:.2f} before, "
                     f"{res.get('load_after', float('nan')):.2f} after)\n")
        lines.append("| weights | what | tokens/request | clients | tokens/s | p50 ms | p90 ms "
                     "| p99 ms | p99.9 ms | max ms |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for dtype in ("fp32", "bf16"):
            r = res.get(dtype)
            if r is None:
                continue
            for s in r["service_steps"]:
                lat = s["latency_ms"]
                what = "epserve service" + (f" ({s['server_flags']})" if s["server_flags"] else "")
                lines.append(
                    f"| {dtype} | {what} | {s['tokens_per_request']} | "
                    f"{s['concurrency']} | {s['tokens_per_s']:.1f} | {lat['p50']:.2f} | "
                    f"{lat['p90']:.2f} | {lat['p99']:.2f} | {lat['p999']:.2f} | "
                    f"{lat['max']:.2f} |")
            for t, v in sorted(r["inprocess"].items()):
                lines.append(f"| {dtype} | kernels in-process | {t} (batch) | 1 | "
                             f"{v['tokens_per_s']:.1f} | {v['median_ms']:.2f} (median) | | | | |")
            for t, v in sorted(r["torch"].items()):
                lines.append(f"| {dtype} | PyTorch {v['torch']} ({v['threads']} thr) | {t} "
                             f"(batch) | 1 | {v['tokens_per_s']:.1f} | {v['median_ms']:.2f} "
                             f"(median) | | | | |")
            blines, bcheck, fastest = baseline_lines(dtype, r)
            lines += blines
            service_best = max(s["tokens_per_s"] for s in r["service_steps"])
            inproc_best = max(v["tokens_per_s"] for v in r["inprocess"].values())
            torch_best = max(v["tokens_per_s"] for v in r["torch"].values())
            one = step(r["service_steps"], 1, 1)
            one_ratio = one["tokens_per_s"] / r["torch"][1]["tokens_per_s"]
            key = "one_token_fp32" if dtype == "fp32" else "one_token_bf16"
            ratios += [
                (shape, dtype, "service saturation / kernels in-process (best batch)",
                 service_best / inproc_best, TARGETS["service_vs_inprocess"]),
                (shape, dtype, "service 1 token, 1 client / PyTorch 1 token", one_ratio,
                 TARGETS[key]),
                (shape, dtype, "service saturation / PyTorch best batch", service_best / torch_best,
                 TARGETS["saturation"]),
            ]
            for t, (best, variant) in sorted(fastest.items()):
                if t in r["inprocess"]:
                    ratios.append((shape, dtype, f"kernels in-process / fastest CPU MoE "
                                   f"baseline at {t} tokens ({variant})",
                                   r["inprocess"][t]["tokens_per_s"] / best,
                                   TARGETS["vs_fastest_baseline"]))
            if "baselines" in r and not fastest:
                lines.append(f"\n{dtype}: no CPU MoE baseline ran\n")
            if bcheck:
                lines.append(bcheck)
            floor = r["inprocess_check"]["floor"]
            lines.append(f"\n{dtype}: service vs PyTorch on the same 16 rows: max rel diff "
                         f"{r['service_vs_torch_rel_error']:.2e}; kernels in-process vs the C++ "
                         f"reference: {r['inprocess_check']['max_rel_error']:.2e}. Memory read "
                         f"{floor['read_gb_per_s']:.1f} GB/s ({floor['threads']} threads, "
                         f"measured before the in-process part); one token reads "
                         f"{floor['one_token_weight_bytes'] / 1e6:.1f} MB of weights, which at "
                         f"that bandwidth takes {floor['one_token_floor_ms']:.2f} ms, "
                         f"{r['torch'][1]['median_ms'] / floor['one_token_floor_ms']:.2f}x "
                         f"faster than PyTorch's 1-token time (the host's bandwidth drifts "
                         f"during a run)\n")
    lines.append("\n| shape | weights | ratio | value | target | met |")
    lines.append("|---|---|---|---:|---:|---|")
    for shape, dtype, name, value, target in ratios:
        shown = f"{value:.2f}"
        if shown == f"{target:.2f}" and value < target:
            shown = f"{value:.3f}"  # rounds to the target but falls short of it
        lines.append(f"| {shape} | {dtype} | {name} | {shown}x | {target}x | "
                     f"{'yes' if value >= target else 'no'} |")
    return "\n".join(lines) + "\n"


def require_torch():
    probe = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        sys.exit("PyTorch is missing for the comparison: run bench/install-deps.sh "
                 "(Debian's python3-torch)")


def main():
    require_torch()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--shapes", default="qwen1.5-moe-a2.7b,olmoe-1b-7b")
    p.add_argument("--duration", default="8s")
    # The closed loop at saturation completes its requests a batch (16 requests) at a time,
    # a batch every 0.5-1 s on a small CPU host: a short window counts +-1 batch of ~10.
    p.add_argument("--saturation-duration", default="24s",
                   help="the throughput step's window (the saturation point)")
    p.add_argument("--max-load", type=float, default=0.6)
    p.add_argument("--load-wait", type=float, default=600)
    p.add_argument("--json-out", help="also write every figure here")
    p.add_argument("--baselines-python", default=os.path.join(DEFAULT_VENV, "bin", "python"),
                   help="interpreter of the CPU MoE baselines' virtual environment "
                   "(bench/install-deps.sh)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the CPU MoE baselines (vLLM, kt-kernel, torch 2.x, ggml)")
    p.add_argument("--isa", choices=["native", *ISA_ENV], default="native",
                   help="avx2: every part on AVX2 and FMA code only (an AVX-512 host standing "
                   "in for an AVX2-only one)")
    a = p.parse_args()
    if a.isa == "avx2" and not {"avx2", "fma"} <= cpu_model_and_flags()[1]:
        sys.exit("--isa=avx2 needs a CPU with AVX2 and FMA")
    if a.no_baselines:
        a.baselines_python = None
    elif not os.access(a.baselines_python, os.X_OK):
        log(f"no CPU MoE baselines: {a.baselines_python} is missing (run bench/install-deps.sh, "
            "or pass --no-baselines)")
        a.baselines_python = None
    a.build = os.path.abspath(a.build)
    env = base_env(a.build, a.isa)
    dtypes = ["fp32", "bf16"]
    results = [bench_shape(a, env, shape, dtypes) for shape in a.shapes.split(",")]
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)
    print(summarize(results, a.isa))
    return 0


if __name__ == "__main__":
    sys.exit(main())
