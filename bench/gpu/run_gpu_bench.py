#!/usr/bin/env python3
"""epserve on NVIDIA GPUs in one call: the kernel tests on the GPU, the expert-FFN, router and
combine timings beside torch.matmul in BF16, the whole MoE layer beside a PyTorch
Hugging-Face-style block, and (with two or more GPUs) an end-to-end run of 1 front-end and 2
GPU workers with every answer checked against the reference, the exchange alone between two
GPUs against a device-to-device copy (bench_device_exchange), and the service sweep over
request sizes, clients and wire dtypes with the stage breakdown, beside the in-process layer
with host copies. Writes the table into BENCHMARKS.md (between the gpu-bench markers) and
prints it. --parts picks some of tests,ffn,layer,decode,e2e,exchange,sweep,cudashm.

    python3 bench/gpu/run_gpu_bench.py --build build [--markdown BENCHMARKS.md]
        [--json results.json] [--quick]

--build is a build folder, or a bundle of the same layout made by bench/gpu/make_bundle.sh
(binaries plus a lib/ folder of the shared libraries a machine without gRPC lacks). Needs
PyTorch with CUDA and NVIDIA's OpenCL driver; the ICD entry
/etc/OpenCL/vendors/nvidia.icd is written when missing. Exits 77 when there is no GPU.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {  # name: (H, F, experts, top_k, shared F, shared gate)
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, 5632, True),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, False),
}
TARGET_MATMUL_RATIO = 0.5   # tensor-core FFN TFLOP/s vs torch.matmul, from 2048 rows up
TARGET_LAYER_SPEEDUP = 2.0  # whole layer vs the PyTorch Hugging-Face-style block


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def setup_icd():
    """NVIDIA's OpenCL driver registers through an ICD file naming libnvidia-opencl.so.1."""
    icd = "/etc/OpenCL/vendors/nvidia.icd"
    if os.path.exists(icd):
        return
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libnvidia-opencl.so.1" not in found:
        log("ldconfig knows no libnvidia-opencl.so.1; the GPU may not be visible to OpenCL")
    try:
        os.makedirs(os.path.dirname(icd), exist_ok=True)
        with open(icd, "w") as f:
            f.write("libnvidia-opencl.so.1\n")
    except OSError as e:
        log(f"could not write {icd}: {e}")


def make_env(build):
    env = dict(os.environ)
    lib = os.path.join(build, "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1",
                "EPSERVE_KERNEL_CACHE": os.path.join(tempfile.gettempdir(), "epserve-kcache"),
                "POCL_MAX_PTHREAD_COUNT": "4",
                # multicast stays off on shared multi-GPU hosts
                "NCCL_NVLS_ENABLE": "0"})
    return env


def run(cmd, env, timeout=1800, check=True):
    log("  $ " + " ".join(cmd))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stdout[-4000:]}\n"
                           f"{r.stderr[-4000:]}")
    return r


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# ---- 1. kernel tests on the GPU ----

def kernel_tests(build, env):
    binary = os.path.join(build, "tests", "kernels", "kernels_test")
    r = run([binary, "--gtest_brief=1"], dict(env, EPSERVE_TEST_DEVICE="gpu"), check=False)
    out = r.stdout + r.stderr
    passed = re.search(r"\[  PASSED  \] (\d+) test", out)
    failed = re.findall(r"\[  FAILED  \] (\S+)", out)
    device = re.search(r"\[ device \] (.*)", out)
    if r.returncode != 0:
        log(out[-6000:])
    return {"ok": r.returncode == 0, "passed": int(passed.group(1)) if passed else 0,
            "failed": sorted(set(failed)), "device": device.group(1) if device else "?"}


# ---- 2. FFN against torch.matmul ----

def cuda_median_ms(fn, min_seconds=0.5):
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    total = 0.0
    while len(times) < 5 or (total < min_seconds and len(times) < 200):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        total += times[-1] / 1e3
    return statistics.median(times)


def torch_matmul_tflops(h, f, experts, rows):
    """The FFN's two GEMMs per expert ([rows, H] x [H, 2F], [rows, F] x [F, H]) in BF16."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=g)
    hm = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = [torch.randn(h, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(experts)]
    w2 = [torch.randn(f, h, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(experts)]

    def fn():
        for e in range(experts):
            torch.matmul(a, w1[e])
            torch.matmul(hm, w2[e])
    ms = cuda_median_ms(fn)
    return ms, experts * rows * 6.0 * h * f / (ms / 1e3) / 1e12


def assembler_report(text):
    """{kernel: {"registers": R, "spilled": bytes}} from the assembler's verbose report, which the
    runtime logs (at debug level) where it builds the sm_90a program: ptxas's "Function
    properties for K", then "N bytes spill stores" and "Used R registers"."""
    out, name = {}, None
    for m in re.finditer(r"Function properties for (\w+)|(\d+) bytes spill stores|"
                         r"Used (\d+) registers", text):
        if m.group(1):
            name = m.group(1)
            out.setdefault(name, {"registers": None, "spilled": 0})
        elif name and m.group(2):
            out[name]["spilled"] = int(m.group(2))
        elif name and m.group(3):
            out[name]["registers"] = int(m.group(3))
    return out


def ffn_part(build, env, rows, shapes):
    # A kernel cache of its own, so that the programs are built here and the assembler's report
    # of the wgmma kernels is logged: past 170 registers three work-groups no longer fit a
    # multiprocessor, which cost 4-14% once (docs/ARCHITECTURE.md) and no timing names.
    with tempfile.TemporaryDirectory(prefix="epserve-ffn-kcache-") as cache:
        out = run([os.path.join(build, "bench", "gpu", "bench_ffn_gpu"), "--device=gpu",
                   f"--shapes={','.join(shapes)}", f"--rows={','.join(map(str, rows))}"],
                  dict(env, EPSERVE_LOG_LEVEL="debug", EPSERVE_KERNEL_CACHE=cache), timeout=1800)
    for line in out.stderr.splitlines():
        if line.startswith("program cache"):
            log("  " + line)
    rows_out = json_lines(out.stdout)
    for r in rows_out:
        if "tflops" in r and r["path"] == "tensor_cores":
            h, f = SHAPES[r["shape"]][:2]
            ms, tflops = torch_matmul_tflops(h, f, r["experts"], r["rows_per_expert"])
            r["torch_ms"], r["torch_tflops"] = ms, tflops
            r["ratio"] = r["tflops"] / tflops
            log(f"  {r['shape']} rows {r['rows_per_expert']}: {r['tflops']:.1f} TFLOP/s vs "
                f"torch.matmul {tflops:.1f} ({r['ratio']:.2f}x)")
    report = {k: v for k, v in assembler_report(out.stderr).items() if k.startswith("ffn_mma_")}
    # The runtime warns where the assembler spilled or serialised the wgmma products. Its full
    # report may be missing: an H200 with driver 580.159.04 gave an empty build log for a build
    # with nothing to warn of, so the warnings (or their absence) are reported apart.
    lines = out.stderr.splitlines()
    built = any("for sm_90a" in line for line in lines)
    warnings = [line.strip() for line in lines
                if "for sm_90a:" in line and ("spilled" in line or "serializ" in line)]
    if report:
        log(f"  the sm_90a build's 128-row kernels: {report}")
    if built:
        log("  the sm_90a build's assembler warnings: " + ("; ".join(warnings) or "none"))
        rows_out.append({"assembler": report, "assembler_warnings": warnings})
    return rows_out


# ---- 3. the whole layer against a Hugging-Face-style PyTorch block ----

def torch_layer_ms(shape, tokens):
    """transformers' sparse MoE block (Qwen2MoeSparseMoeBlock / MixtralSparseMoeBlock): router
    linear, softmax, top-k (Qwen1.5-MoE does not renormalise, Mixtral does), a loop over the
    experts that were hit with index_select and index_add_, the shared expert with its sigmoid
    gate; BF16 weights and activations on the GPU, random weights of the model's shapes."""
    import torch
    import torch.nn.functional as F
    h, f, e_count, k, shared_f, shared_gate = SHAPES[shape]
    norm = shape.startswith("mixtral")
    g = torch.Generator(device="cuda").manual_seed(1)
    dt = torch.bfloat16

    def lin(o, i):
        return torch.randn(o, i, device="cuda", dtype=dt, generator=g) * (i ** -0.5)
    router = lin(e_count, h)
    experts = [(lin(f, h), lin(f, h), lin(h, f)) for _ in range(e_count)]
    shared = (lin(shared_f, h), lin(shared_f, h), lin(h, shared_f)) if shared_f else None
    sgate = lin(1, h) if shared_gate else None
    x = torch.randn(tokens, h, device="cuda", dtype=dt, generator=g)

    def block():
        logits = F.linear(x, router)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, k, dim=-1)
        if norm:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(dt)
        final = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=e_count).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e)
            idx, top_x = torch.where(mask[e])
            cur = x[None, top_x].reshape(-1, h)
            gw, uw, dw = experts[e]
            y = F.linear(F.silu(F.linear(cur, gw)) * F.linear(cur, uw), dw)
            final.index_add_(0, top_x, (y * weights[top_x, idx, None]).to(dt))
        if shared is not None:
            gw, uw, dw = shared
            s = F.linear(F.silu(F.linear(x, gw)) * F.linear(x, uw), dw)
            if sgate is not None:
                s = torch.sigmoid(F.linear(x, sgate)) * s
            final = final + s
        return final
    with torch.no_grad():
        return cuda_median_ms(block, 1.0)


def inprocess_runs(build, env, shape, tokens, stages=False):
    """bench_e2e_inprocess on GPU 0, BF16, with the pairs grouped on the host and on the
    device: {(tokens, grouping): figures} and the check lines."""
    cmd = [os.path.join(build, "bench", "e2e", "bench_e2e_inprocess"),
           f"--model=synthetic:{shape}", "--device=gpu", "--weight-dtype=bf16",
           f"--tokens={','.join(map(str, tokens))}", "--min-seconds=1", "--check-tokens=4",
           "--grouping=host,device"] + (["--stages"] if stages else [])
    lines = json_lines(run(cmd, env, timeout=1800).stdout)
    checks = [r for r in lines if "check_tokens" in r]
    runs = {(r["tokens"], r["grouping"]): r for r in lines if "median_ms" in r}
    return runs, checks


def torch_baselines_module():
    """bench/gpu/torch_baselines.py (needs PyTorch with CUDA)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import torch_baselines
    return torch_baselines


def grouped_mm_baselines(shapes, tokens):
    """The torch._grouped_mm MoE layer (bench/gpu/torch_baselines.py) per (shape, tokens)."""
    return {(r["shape"], r["tokens"]): r
            for r in torch_baselines_module().layer_figures(shapes, tokens)}


def layer_rows(build, env, shapes, tokens, stages=False, hf_block=True):
    base = grouped_mm_baselines(shapes, tokens)
    results = []
    weight_bytes = torch_baselines_module().weight_bytes
    for shape in shapes:
        runs, checks = inprocess_runs(build, env, shape, tokens, stages)
        for t in tokens:
            dev, host, g = runs[(t, "device")], runs[(t, "host")], base[(shape, t)]
            r = {"shape": shape, "tokens": t, "resident_ms": dev["resident_median_ms"],
                 "epserve_ms": dev["median_ms"], "host_grouping_ms": host["resident_median_ms"],
                 "grouped_mm_graph_ms": g["graph_ms"], "grouped_mm_eager_ms": g["eager_ms"],
                 "read_GBps": g["read_GBps"], "grouped_mm_bound_ms": g["bound_ms"],
                 "tensor_cores": checks[0]["tensor_cores"],
                 "max_rel_error": max(c["max_rel_error"] for c in checks)}
            # The bound of epserve's own batch: the experts its routing touched (which differ
            # from torch's routing's, by several at 16 tokens), at the read rate of this call;
            # torch's batch's where the build does not print the count.
            touched = dev.get("experts_touched", -1)
            r["experts_touched"] = touched
            r["bound_ms"] = (weight_bytes(shape, touched) / (g["read_GBps"] * 1e9) * 1e3
                             if touched >= 0 else g["bound_ms"])
            r["over_grouped_mm"] = g["graph_ms"] / r["resident_ms"]
            r["over_bound"] = r["resident_ms"] / r["bound_ms"]
            if stages:
                r["stages_device"], r["stages_host"] = dev.get("stages_ms"), host.get("stages_ms")
            if hf_block:
                r["torch_ms"] = torch_layer_ms(shape, t)
                r["speedup"] = r["torch_ms"] / r["resident_ms"]
                r["speedup_with_copies"] = r["torch_ms"] / r["epserve_ms"]
            results.append(r)
            log(f"  layer {shape} tokens {t}: epserve {r['resident_ms']:.3f} ms (host grouping "
                f"{r['host_grouping_ms']:.3f}), grouped_mm graph {g['graph_ms']:.3f}, bound "
                f"{r['bound_ms']:.3f} ({r['experts_touched']} experts; -1: torch's batch)")
    return results


def layer_part(build, env, shapes, tokens):
    return layer_rows(build, env, shapes, tokens)


def decode_part(build, env, shapes, tokens, gpus):
    """Decode-sized layers on one GPU: the in-process layer (pairs grouped on the device and on
    the host) with each stage timed alone, beside the grouped_mm layer and the weight-read
    bound; then one client's latency through the service (qwen1.5-moe-a2.7b) on one GPU, and
    on two where there are two."""
    rows = layer_rows(build, env, shapes, tokens, stages=True, hf_block=False)
    service = []
    for workers in (1, 2) if gpus >= 2 else (1,):
        try:
            service += service_latency(build, env, "synthetic:qwen1.5-moe-a2.7b", workers,
                                       tokens)
        except RuntimeError as e:
            log(f"  the service with {workers} worker(s) did not run: {e}")
    return {"layers": rows, "service": service, "grpc_echo_ms": grpc_echo_ms(build, env)}


def grpc_echo_ms(build, env):
    """p50 ms of one client's ModelInfer against a bare gRPC echo on this host
    (bench_frontend, 1 token inline): what any gRPC service pays per request before a layer
    runs, so that the in-process layer plus it is the floor of the service's latency; None
    where bench_frontend is not in the build."""
    exe = os.path.join(build, "bench", "frontend", "bench_frontend")
    if not os.path.exists(exe):
        return None
    out = run([exe, "--tokens=1", "--clients=1", "--seconds=3"], env, timeout=120, check=False)
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == "1":
            return float(cells[2]) / 1e3
    return None


# ---- 4. end to end on two GPUs ----

@contextlib.contextmanager
def served(build, env, model, workers, flags=(), device="gpu"):
    """`mpirun -np 1+workers epserve` on `device` until the block ends; yields (address, log
    path). The workers take one GPU each."""
    work = tempfile.mkdtemp(prefix="epserve-gpu-serve-")
    ready = os.path.join(work, "ready.json")
    cmd = ["mpirun", "-np", str(1 + workers), "--bind-to", "none", "-x", "LD_LIBRARY_PATH",
           "-x", "EPSERVE_KERNEL_CACHE", "-x", "NCCL_NVLS_ENABLE",
           os.path.join(build, "server", "epserve"), f"--model={model}", f"--device={device}",
           "--weight-dtype=bf16", "--grpc-address=127.0.0.1:0", "--metrics-address=127.0.0.1:0",
           "--max-batch-tokens=4096", f"--ready-file={ready}", *flags]
    log("  $ " + " ".join(cmd))
    logf = open(os.path.join(work, "log.txt"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + 600
        while not os.path.exists(ready) or os.path.getsize(ready) == 0:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("epserve did not start:\n" + open(logf.name).read()[-4000:])
            time.sleep(0.5)
        time.sleep(0.2)
        yield json.load(open(ready))["grpc"], logf.name
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        logf.close()
        shutil.rmtree(work, ignore_errors=True)


def e2e_part(build, env, gpus):
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s); the end-to-end run needs 2"}
    model = "synthetic:qwen1.5-moe-a2.7b"
    result = {}
    with served(build, env, model, 2) as (address, log_path):
        load = os.path.join(build, "client", "epserve-load")
        verify = run([load, f"--target={address}", f"--verify-model={model}",
                      "--verify-tolerance=1e-2", "--tokens=16", "--concurrency=4",
                      "--requests=48", "--json", "--progress=off", "--fail-on-error"], env,
                     timeout=900, check=False)
        steps = json_lines(verify.stdout)
        result["verify"] = {"exit": verify.returncode, "steps": steps,
                            "stderr": verify.stderr[-2000:]}
        tput = run([load, f"--target={address}", "--tokens=256", "--concurrency=1,8",
                    "--duration=10s", "--warmup=3s", "--json", "--progress=off"], env,
                   timeout=600, check=False)
        result["throughput"] = json_lines(tput.stdout)
        text = open(log_path).read()
    # "worker 0 on 1:0 NVIDIA CUDA / NVIDIA H200 (gpu, ...): N weight bytes, ..."
    result["workers"] = re.findall(r"worker \d+ on .*?\)(?=:)", text)
    result["log_tail"] = text[-3000:]
    return result


def service_latency(build, env, model, workers, tokens, device="gpu"):
    """One client's p50 and p99 through the service (1 front-end + `workers` workers), with
    shared-memory and with inline requests, for each token count: [{tokens, shm, p50_ms,
    p99_ms, tokens_per_s}]."""
    rows = []
    with served(build, env, model, workers, device=device) as (address, _):
        load = os.path.join(build, "client", "epserve-load")
        for t in tokens:
            for shm in (True, False):
                r = run([load, f"--target={address}", f"--tokens={t}", "--concurrency=1",
                         "--duration=3s", "--warmup=1s", f"--shared-memory={str(shm).lower()}",
                         "--json", "--progress=off"], env, timeout=120, check=False)
                for step in json_lines(r.stdout):
                    lat = step.get("latency_ms") or {}
                    rows.append({"workers": workers, "tokens": t, "shm": shm,
                                 "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
                                 "tokens_per_s": step.get("tokens_per_s")})
    return rows


def cudashm_part(build, env, gpus, tokens=4096):
    """KServe CUDA shared memory: tests/e2e/cuda_shm_test.py (the unmodified tritonclient) with
    one GPU worker and, where there are two GPUs, two; then qwen1.5-moe-a2.7b BF16 at `tokens`
    tokens a request through the service with CUDA shared-memory clients
    (cuda_shm_bench.py) and with system shared memory (epserve-load), beside the resident
    in-process layer summed over the workers' GPUs, all in this call."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    result = {"tests": [], "service": []}
    counts = (1, 2) if gpus >= 2 else (1,)
    for workers in counts:
        tenv = dict(env, EPSERVE_BINARY=os.path.join(build, "server", "epserve"),
                    EPSERVE_MPIEXEC="mpirun", EPSERVE_GPU_WORKERS=str(workers),
                    PYTHONPATH=os.pathsep.join(
                        [os.path.join(root, "client", "python"),
                         os.path.join(root, "tests", "e2e"), env.get("PYTHONPATH", "")]))
        r = run([sys.executable, os.path.join(root, "tests", "e2e", "cuda_shm_test.py")], tenv,
                timeout=900, check=False)
        result["tests"].append({"workers": workers, "exit": r.returncode,
                                "tail": (r.stdout + r.stderr)[-4000:]})
        log(f"  cuda_shm_test, {workers} worker(s): exit {r.returncode}")
        log((r.stdout + r.stderr)[-2500:])
    runs, _ = inprocess_runs(build, env, "qwen1.5-moe-a2.7b", [tokens])
    resident = min(v["resident_median_ms"] for v in runs.values())
    result["resident_ms"] = resident
    model = "synthetic:qwen1.5-moe-a2.7b"
    for workers in counts:
        bound = workers * tokens / resident * 1e3  # tokens/s of the resident layer, each GPU
        with served(build, env, model, workers) as (address, _):
            r = run([sys.executable, os.path.join(here, "cuda_shm_bench.py"),
                     f"--address={address}", "--hidden=2048", f"--tokens={tokens}",
                     "--concurrency=2,4", "--duration=5"], env, timeout=300, check=False)
            if r.returncode != 0:
                log(f"  cuda_shm_bench.py exit {r.returncode}:\n{r.stdout[-2000:]}\n"
                    f"{r.stderr[-3000:]}")
            rows = [dict(x, path="cuda shm") for x in json_lines(r.stdout)]
            # Decode sizes, one client: CUDA shared memory beside system shared memory.
            for t in (16, 128):
                r = run([sys.executable, os.path.join(here, "cuda_shm_bench.py"),
                         f"--address={address}", "--hidden=2048", f"--tokens={t}",
                         "--concurrency=1", "--duration=3"], env, timeout=120, check=False)
                rows += [dict(x, path="cuda shm, decode") for x in json_lines(r.stdout)]
                r = run([os.path.join(build, "client", "epserve-load"), f"--target={address}",
                         f"--tokens={t}", "--dtype=BF16", "--concurrency=1", "--duration=3s",
                         "--warmup=1s", "--shared-memory=true", "--json", "--progress=off"], env,
                        timeout=120, check=False)
                for step in json_lines(r.stdout):
                    lat = step.get("latency_ms") or {}
                    rows.append({"path": "system shm, decode", "tokens": t, "concurrency": 1,
                                 "tokens_per_s": step.get("tokens_per_s"),
                                 "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99")})
            load = os.path.join(build, "client", "epserve-load")
            r = run([load, f"--target={address}", f"--tokens={tokens}", "--dtype=BF16",
                     "--concurrency=2,4", "--duration=5s", "--warmup=1s",
                     "--shared-memory=true", "--json", "--progress=off"], env, timeout=300,
                    check=False)
            for step in json_lines(r.stdout):
                lat = step.get("latency_ms") or {}
                rows.append({"path": "system shm", "concurrency": step.get("concurrency"),
                             "tokens_per_s": step.get("tokens_per_s"), "p50_ms": lat.get("p50"),
                             "p99_ms": lat.get("p99")})
        for x in rows:
            x["workers"] = workers
            line = (f"  {workers} worker(s), {x['path']}, {x.get('tokens', tokens)} tokens, "
                    f"concurrency {x.get('concurrency')}: {x.get('tokens_per_s') or 0:.0f} "
                    f"tokens/s, p50 {x.get('p50_ms')}")
            if x.get("tokens", tokens) == tokens:  # the resident layer's size: its ratio
                x.update(resident_tokens_per_s=bound,
                         over_resident=(x.get("tokens_per_s") or 0) / bound)
                line += f" = {x['over_resident']:.2f}x the resident layer ({bound:.0f})"
            log(line)
        result["service"] += rows
    return result


def nccl_all_to_all(env, gpus, byte_counts):
    """NCCL's all-to-all of each byte count per rank to its peers (torch_baselines.py under
    torchrun, one process per GPU): {bytes: figures}."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_baselines.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
           "--master_port=29533", script, "all_to_all",
           f"--bytes={','.join(str(int(b)) for b in byte_counts)}"]
    r = run(cmd, env, timeout=300, check=False)
    if r.returncode != 0:
        log(r.stderr[-3000:])
    return {x["bytes_per_rank_to_peers"]: x for x in json_lines(r.stdout)}


def exchange_part(build, env, gpus):
    """The exchange alone between two GPUs (bench_device_exchange), against a device-to-device
    copy of the same bytes and NCCL's all-to-all of the same bytes, qwen1.5-moe-a2.7b's shape,
    4096 tokens and 128 per GPU."""
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s); the exchange needs 2"}
    out = []
    for tokens in (4096, 256):
        for shared in ("split", "owner"):
            cmd = ["mpirun", "-np", "2", "--bind-to", "none", "-x", "LD_LIBRARY_PATH",
                   os.path.join(build, "bench", "gpu", "bench_device_exchange"),
                   f"--shared-expert={shared}", f"--tokens={tokens}", "--hidden=2048",
                   "--experts=60", "--top-k=4", "--reps=200" if tokens < 1024 else "--reps=50"]
            log("  $ " + " ".join(cmd))
            r = run(cmd, env, timeout=300, check=False)
            figures = {x["figure"]: x for x in json_lines(r.stdout) if "figure" in x}
            out.append({"shared_expert": shared, "tokens": tokens, "exit": r.returncode,
                        "figures": figures, "stderr": r.stderr[-1500:]})
    sizes = sorted({f[step]["bytes_per_rank"] for e in out for f in [e["figures"]]
                    for step in ("dispatch", "combine_return") if step in f})
    nccl = nccl_all_to_all(env, 2, [b for b in sizes if b > 0]) if sizes else {}
    for e in out:
        for step in ("dispatch", "combine_return"):
            f = e["figures"].get(step)
            if f and int(f["bytes_per_rank"]) in nccl:
                e["figures"][f"nccl_of_{step}"] = nccl[int(f["bytes_per_rank"])]
    return out


def sweep_part(build, env, gpus):
    """The service on every GPU (1 front-end + one worker per GPU, rows device to device) over
    request sizes and clients, BF16 and FP32 on the wire, shared-memory and inline requests,
    with rank 0's and the workers' stage times (bench/e2e/shm_vs_inline.py), and the in-process
    layer with host copies per GPU as the bound."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e",
                          "shm_vs_inline.py")
    inproc = run([os.path.join(build, "bench", "e2e", "bench_e2e_inprocess"), "--device=gpu",
                  "--weight-dtype=bf16", "--tokens=4096", "--check-tokens=0",
                  "--pinned-transfers"], env, timeout=300, check=False)
    res = {"inprocess": json_lines(inproc.stdout), "runs": []}
    for dtype in ("BF16", "FP32"):
        for tokens in (256, 1024, 4096):
            cmd = [sys.executable, script, "--build", build,
                   "--model", "synthetic:qwen1.5-moe-a2.7b", "--workers", str(gpus),
                   "--epserve-flags=--device=gpu --weight-dtype=bf16 --max-batch-tokens=4096",
                   "--tokens", str(tokens), "--dtype", dtype, "--concurrency", "1,8,32",
                   "--duration", "5s", "--rounds", "1"]
            log("  $ " + " ".join(cmd))
            r = run(cmd, env, timeout=900, check=False)
            res["runs"].append({"dtype": dtype, "tokens": tokens, "exit": r.returncode,
                                "table": [l for l in r.stdout.splitlines() if l.startswith("|")]})
    return res


# ---- table ----

def markdown(res):
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {res['gpu']} "
             f"({res['gpus']} GPU(s) on the host), with "
             "`python3 bench/gpu/run_gpu_bench.py --build <build or bundle>`; PyTorch "
             f"{res['torch']} in the same run.", ""]
    asked = res["parts"]
    kt = res["kernel_tests"]
    if "tests" in asked:
        lines.append(f"Kernel tests on the GPU (`EPSERVE_TEST_DEVICE=gpu kernels_test`, device "
                     f"{kt['device']}): {'passed' if kt['ok'] else 'FAILED'}, {kt['passed']} "
                     "passed" + (f", failed: {', '.join(kt['failed'])}" if kt["failed"] else "")
                     + ".")
    else:
        lines.append("Kernel tests on the GPU: not run (not asked for).")
    if "ffn" in asked:
        lines += ["", "Expert FFN, BF16 weights (gate/up, SwiGLU, down; 6·H·F FLOPs per row), "
                  "experts × rows per expert, against torch.matmul on the same two GEMMs per "
                  "expert (target: ≥ 0.5× from 2048 rows up):", "",
                  "| shape | experts × rows | path | ms | TFLOP/s | torch.matmul TFLOP/s | ratio |"
                  " router ms | combine ms |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        aux = {(r["shape"], r["tokens"]): r for r in res["ffn"] if "route_ms" in r}
        for r in res["ffn"]:
            if "tflops" not in r:
                continue
            tokens = max(1, r["experts"] * r["rows_per_expert"] // SHAPES[r["shape"]][3])
            a = aux.get((r["shape"], tokens)) if r["path"] == "tensor_cores" else None
            lines.append(
                f"| {r['shape']} | {r['experts']} × {r['rows_per_expert']} | {r['path']} | "
                f"{r['ms']:.3f} | {r['tflops']:.1f} | "
                + (f"{r['torch_tflops']:.1f} | {r['ratio']:.2f}× | " if "ratio" in r else "– | – | ")
                + (f"{a['route_ms']:.3f} ({a['tokens']} tok) | {a['combine_ms']:.3f} |" if a
                   else "– | – |"))
        built = next((r for r in res["ffn"] if "assembler" in r), None)
        if built and built["assembler"]:
            lines += ["", "The 128-row wgmma kernels as the assembler reports them (three "
                      "work-groups a multiprocessor need at most 170 registers): " + ", ".join(
                          f"{k} {v['registers']} registers, {v['spilled']} bytes spilled"
                          for k, v in sorted(built["assembler"].items())) + "."]
        if built:
            lines += ["", "The sm_90a build's assembler warnings (spilled registers, serialised "
                      "wgmma products): " + (
                          "; ".join(built.get("assembler_warnings", [])) or "none") + "."]
    else:
        lines += ["", "Expert FFN against torch.matmul: not run (not asked for)."]
    if "layer" in asked:
        lines += ["", "Whole MoE layer on one GPU (bench_e2e_inprocess: route, the pairs grouped "
                  "by expert on the device, expert FFN, combine, shared expert; x on the GPU and "
                  "the output left there) against the same layer in PyTorch through "
                  "torch._grouped_mm replayed from a CUDA graph (bench/gpu/torch_baselines.py; "
                  "target: faster) and the Hugging-Face-style block (a loop over experts, the "
                  "naive reference); the weight-read bound is the bytes of the experts epserve's "
                  "batch touches plus the shared expert and the router over torch.sum's read "
                  "rate:", "",
                  "| shape | tokens | epserve ms | host grouping ms | with host copies ms | "
                  "grouped_mm graph ms | grouped_mm eager ms | HF block ms | vs grouped_mm | "
                  "bound ms | max rel. error |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in res["layer"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['resident_ms']:.3f} | "
                         f"{r['host_grouping_ms']:.3f} | {r['epserve_ms']:.3f} | "
                         f"{r['grouped_mm_graph_ms']:.3f} | {r['grouped_mm_eager_ms']:.3f} | "
                         f"{r.get('torch_ms', 0):.3f} | {r['over_grouped_mm']:.2f}× | "
                         f"{r['bound_ms']:.3f} | {r['max_rel_error']:.2e} |")
    else:
        lines += ["", "Whole MoE layer against PyTorch: not run (not asked for)."]
    if "decode" in asked:
        lines += ["", "Decode-sized layers on one GPU, the same columns with the layer's stages "
                  "each timed alone (each ended by a wait, so their sum exceeds the layer), pairs "
                  "grouped on the device / on the host (target: faster than grouped_mm under a "
                  "graph and ≤ 1.5× the bound):", "",
                  "| shape | tokens | epserve ms | host grouping ms | grouped_mm graph ms | "
                  "grouped_mm eager ms | vs grouped_mm | bound ms | × bound | stages ms, device "
                  "grouping | stages ms, host grouping |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        def st(d):
            return " ".join(f"{k} {v:.3f}" for k, v in (d or {}).items() if v >= 0.0005)
        decode = res["decode"]
        if isinstance(decode, list):  # results of an older version: the layers alone
            decode = {"layers": decode, "service": []}
        for r in decode["layers"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['resident_ms']:.3f} | "
                         f"{r['host_grouping_ms']:.3f} | {r['grouped_mm_graph_ms']:.3f} | "
                         f"{r['grouped_mm_eager_ms']:.3f} | {r['over_grouped_mm']:.2f}× | "
                         f"{r['bound_ms']:.3f} | {r['over_bound']:.2f}× | "
                         f"{st(r.get('stages_device'))} | {st(r.get('stages_host'))} |")
        if decode["service"]:
            resident = {r["tokens"]: r["resident_ms"] for r in decode["layers"]
                        if r["shape"] == "qwen1.5-moe-a2.7b"}
            echo = decode.get("grpc_echo_ms")
            lines += ["", "One client through the service (qwen1.5-moe-a2.7b, BF16 weights, "
                      "`epserve-load --concurrency=1`), shared-memory and inline requests, "
                      "against the in-process layer above (target: shared memory ≤ that + "
                      "0.25 ms) and the floor of a gRPC service on this host, the layer plus a "
                      "bare gRPC echo of one request (bench_frontend, same call: "
                      + (f"{echo:.3f} ms" if echo else "not measured") + "):", "",
                      "| workers (GPUs) | tokens | shm p50 ms | shm p99 ms | inline p50 ms | "
                      "inline p99 ms | in-process + 0.25 ms | in-process + echo ms |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            by = {(r["workers"], r["tokens"], r["shm"]): r for r in decode["service"]}
            for (w, t) in sorted({(r["workers"], r["tokens"]) for r in decode["service"]}):
                s_, i_ = by.get((w, t, True), {}), by.get((w, t, False), {})
                bound = resident.get(t)
                lines.append(f"| {w} | {t} | {s_.get('p50_ms') or 0:.3f} | "
                             f"{s_.get('p99_ms') or 0:.3f} | {i_.get('p50_ms') or 0:.3f} | "
                             f"{i_.get('p99_ms') or 0:.3f} | "
                             + (f"{bound + 0.25:.3f} |" if bound else "– |")
                             + (f" {bound + echo:.3f} |" if bound and echo else " – |"))
    e2e = res["e2e"]
    lines.append("")
    if "skipped" in e2e:
        lines.append(f"End to end: not run ({e2e['skipped']}).")
    else:
        v = e2e.get("verify", {})
        st = v.get("steps", [{}])
        s0 = st[0] if st else {}
        lines.append("End to end, 1 front-end + 2 GPU workers (`mpirun -np 3 epserve "
                     "--device=gpu --weight-dtype=bf16`, qwen1.5-moe-a2.7b): "
                     + "; ".join(e2e.get("workers", [])) + ".")
        lines.append(f"Every answer checked against the reference (epserve-load --verify, "
                     f"tolerance 1e-2): exit {v.get('exit')}, {s0.get('requests', '?')} "
                     f"requests, {s0.get('ok', '?')} ok, {s0.get('verified', '?')} verified, "
                     f"errors {json.dumps(s0.get('errors', {}))}.")
        for t in e2e.get("throughput", []):
            lat = t.get("latency_ms") or {}
            lines.append(f"- 256 tokens per request, concurrency {t.get('concurrency')}: "
                         f"{t.get('tokens_per_s', 0):.0f} tokens/s, p50 "
                         f"{lat.get('p50') or 0:.1f} ms, p99 {lat.get('p99') or 0:.1f} ms")
    ex = res.get("exchange", {"skipped": "not asked for"})
    lines.append("")
    if isinstance(ex, dict):
        lines.append(f"The exchange alone between two GPUs: not run ({ex['skipped']}).")
    else:
        lines += ["The exchange alone between two GPUs (`mpirun -np 2 bench_device_exchange`, "
                  "H 2048, top-4 of 60 experts, rows device to device, tokens over both GPUs), "
                  "GB/s per direction against a device-to-device copy of the same bytes "
                  "(clEnqueueCopyBuffer into the peer's imported memory) and NCCL's all-to-all of "
                  "the same bytes (torch.distributed.all_to_all_single), same run (targets: "
                  "≥ 0.8× the copy, ≥ 1.0× NCCL):", "",
                  "| tokens | shared expert | step | MB per GPU | ms | GB/s | copy GB/s | "
                  "vs copy | NCCL ms | vs NCCL |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for e in ex:
            f = e["figures"]
            for step, copy in (("dispatch", "copy_of_dispatch_bytes"),
                               ("combine_return", "copy_of_combine_bytes")):
                if step not in f or copy not in f:
                    lines.append(f"| {e.get('tokens', 4096)} | {e['shared_expert']} | {step} | "
                                 f"failed (exit {e['exit']}) | | | | | | |")
                    continue
                a, b = f[step], f[copy]
                n = f.get(f"nccl_of_{step}")
                lines.append(f"| {e.get('tokens', 4096)} | {e['shared_expert']} | {step} | "
                             f"{a['bytes_per_rank'] / 1e6:.2f} | {a['ms']:.3f} | "
                             f"{a['gb_per_s']:.1f} | {b['gb_per_s']:.1f} | {b['ms'] / a['ms']:.2f}× | "
                             + (f"{n['ms']:.3f} | {n['ms'] / a['ms']:.2f}× |" if n else "– | – |"))
    sw = res.get("sweep")
    if sw:
        lines.append("")
        ip = sw["inprocess"][0] if sw["inprocess"] else {}
        lines.append(f"Service sweep on {res['gpus']} GPU(s) (bench/e2e/shm_vs_inline.py, "
                     "qwen1.5-moe-a2.7b, BF16 weights); the in-process layer with host copies "
                     f"on one GPU: {ip.get('median_ms', 0):.2f} ms for 4096 tokens "
                     f"({ip.get('tokens_per_s', 0):,.0f} tokens/s).")
        for r in sw["runs"]:
            lines += ["", f"{r['tokens']} tokens per request, {r['dtype']} on the wire "
                      f"(exit {r['exit']}):", ""] + r["table"]
    return "\n".join(lines) + "\n"


def write_markdown(path, table):
    begin, end = "<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->"
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n## On NVIDIA GPUs\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--markdown", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "BENCHMARKS.md"))
    ap.add_argument("--json", default="")
    ap.add_argument("--rows", default="128,512,2048,4096,8192")
    ap.add_argument("--layer-tokens", default="128,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--decode-tokens", default="1,16,128,512")
    ap.add_argument("--parts", default="tests,ffn,layer,e2e,exchange,sweep",
                    help="comma list of tests,ffn,layer,decode,e2e,exchange,sweep,cudashm")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        log("PyTorch is needed for the baselines")
        return 77
    if not torch.cuda.is_available():
        log("no CUDA GPU: nothing to measure")
        return 77
    setup_icd()
    build = os.path.abspath(a.build)
    env = make_env(build)
    shapes = [s for s in a.shapes.split(",") if s]
    parts = a.parts.split(",")
    res = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
           "torch": torch.__version__, "kernel_tests": {"ok": False, "passed": 0, "failed": [],
                                                        "device": "not run"},
           "parts": parts, "ffn": [], "layer": [], "decode": [],
           "e2e": {"skipped": "not asked for"}}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
    if "tests" in parts:
        res["kernel_tests"] = kernel_tests(build, env)
        save()
    if "ffn" in parts:
        res["ffn"] = ffn_part(build, env, [int(r) for r in a.rows.split(",")], shapes)
        save()
    if "layer" in parts:
        res["layer"] = layer_part(build, env, shapes, [int(t) for t in a.layer_tokens.split(",")])
        save()
    if "decode" in parts:
        res["decode"] = decode_part(build, env, shapes,
                                    [int(t) for t in a.decode_tokens.split(",")], res["gpus"])
        save()
    if "e2e" in parts:
        res["e2e"] = e2e_part(build, env, res["gpus"])
        save()
    if "exchange" in parts:
        res["exchange"] = exchange_part(build, env, res["gpus"])
        save()
    if "sweep" in parts:
        res["sweep"] = sweep_part(build, env, res["gpus"])
        save()
    if "cudashm" in parts:
        res["cudashm"] = cudashm_part(build, env, res["gpus"])
        save()
    table = markdown(res)
    print(table)
    write_markdown(a.markdown, table)
    ok = res["kernel_tests"]["ok"] or "tests" not in parts
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
