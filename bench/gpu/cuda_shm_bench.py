"""Closed-loop clients whose rows stay in GPU memory (KServe CUDA shared memory, through the
unmodified tritonclient and cuda.bindings): each client registers an input and an output
region on GPU `--device`, fills the input once with random rows and sends requests naming them
back to back for `--duration` seconds. Prints one JSON line per concurrency: tokens/s and the
latency percentiles. Run by run_gpu_bench.py's cudashm part against a running epserve.
"""

import argparse
import faulthandler
import json
import threading
import time

import numpy as np
import tritonclient.grpc as triton
import tritonclient.utils.cuda_shared_memory as cudashm

WIDTH = {"FP32": 4, "BF16": 2, "FP16": 2}


class Client:
    """One client's connection and its two regions (made in the main thread: the CUDA calls of
    tritonclient.utils.cuda_shared_memory are not made from several threads at once)."""

    def __init__(self, address, cid, tokens, hidden, datatype, device):
        self.client = triton.InferenceServerClient(address)
        nbytes = tokens * hidden * WIDTH[datatype]
        self.names = (f"bench_in_{cid}", f"bench_out_{cid}")
        self.regions = [cudashm.create_shared_memory_region(n, nbytes, device)
                        for n in self.names]
        for name, region in zip(self.names, self.regions):
            self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(region), device,
                                                    nbytes)
        x = np.random.default_rng().uniform(-1, 1, size=tokens * hidden).astype(np.float32)
        raw = x if datatype == "FP32" else (
            x.astype(np.float16) if datatype == "FP16" else (x.view(np.uint32) >> 16).astype(
                np.uint16))
        cudashm.set_shared_memory_region(self.regions[0], [np.frombuffer(raw.tobytes(), np.uint8)])
        self.inp = triton.InferInput("hidden_states", [tokens, hidden], datatype)
        self.inp.set_shared_memory(self.names[0], nbytes)
        self.out = triton.InferRequestedOutput("moe_output")
        self.out.set_shared_memory(self.names[1], nbytes)

    def loop(self, until, warm_until, lat, errors):
        while time.time() < until:
            began, t0 = time.time(), time.perf_counter()
            try:
                self.client.infer("moe", [self.inp], outputs=[self.out])
            except Exception as e:  # counted, not fatal: the figure says how many failed
                errors.append(str(e)[:200])
                continue
            if began >= warm_until:
                lat.append(time.perf_counter() - t0)

    def close(self):
        for name in self.names:
            self.client.unregister_cuda_shared_memory(name)
        for region in self.regions:
            cudashm.destroy_shared_memory_region(region)
        self.client.close()


def main():
    faulthandler.enable()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--datatype", default="BF16", choices=sorted(WIDTH))
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args()
    for c in [int(v) for v in a.concurrency.split(",")]:
        lat, errors = [], []
        clients = [Client(a.address, i, a.tokens, a.hidden, a.datatype, a.device)
                   for i in range(c)]
        start = time.time()
        warm_until, until = start + a.warmup, start + a.warmup + a.duration
        threads = [threading.Thread(target=cl.loop, args=(until, warm_until, lat, errors))
                   for cl in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for cl in clients:
            cl.close()
        ms = sorted(v * 1e3 for v in lat)
        pick = (lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]) if ms else (lambda q: None)
        print(json.dumps({"tokens": a.tokens, "datatype": a.datatype, "concurrency": c,
                          "requests": len(ms), "errors": len(errors),
                          "first_error": errors[0] if errors else "",
                          "tokens_per_s": len(ms) * a.tokens / a.duration,
                          "p50_ms": pick(0.5), "p99_ms": pick(0.99)}), flush=True)


if __name__ == "__main__":
    main()
