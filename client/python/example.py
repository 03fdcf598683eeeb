#!/usr/bin/python3
"""Sends a batch of random token rows through a running epserve and prints what came back.

    PYTHONPATH=build/proto/python:client/python /usr/bin/python3 client/python/example.py \\
        --target 127.0.0.1:8001 --tokens 4

Asks the server for the hidden size (ModelMetadata), runs the layer once in FP32 and once
in BF16 on the same rows, and prints the shapes, the time of each call and how far the BF16
answer is from the FP32 one. Exit status 0 when both calls succeed. With --shared-memory (on
the server's host) the rows go through a registered POSIX shared-memory region instead of
the gRPC messages, and the answers are checked against the same calls sent inline.
"""

import argparse
import sys
import time

import numpy as np

import epserve_client


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:8001", help="host:port of epserve's gRPC")
    p.add_argument("--model", default="moe", help="model name (epserve --model-name)")
    p.add_argument("--tokens", type=int, default=4, help="token rows to send")
    p.add_argument("--layer", type=int, default=None, help="MoE layer (default: the first)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls-ca", help="PEM file of the server's CA (TLS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-memory", action="store_true",
                   help="send and receive the rows through system shared memory")
    a = p.parse_args()

    token = open(a.token_file).read().strip() if a.token_file else None
    ca = open(a.tls_ca, "rb").read() if a.tls_ca else None
    client = epserve_client.Client(a.target, a.model, token=token, root_certificates=ca)
    hidden = client.model_metadata().inputs[0].shape[1]
    client.close()

    x = np.random.default_rng(a.seed).uniform(-1, 1, size=(a.tokens, hidden)).astype(np.float32)
    if a.shared_memory:
        return shared_memory_calls(a, token, ca, hidden, x)
    kwargs = dict(address=a.target, model=a.model, layer=a.layer, token=token,
                  root_certificates=ca)
    t0 = time.perf_counter()
    y = epserve_client.moe_layer(x, **kwargs)
    t1 = time.perf_counter()
    y_bf16 = epserve_client.moe_layer(x, datatype="BF16", **kwargs)
    t2 = time.perf_counter()

    rel = float(np.abs(y_bf16 - y).max() / max(np.abs(y).max(), 1e-30))
    print(f"input  {x.shape} {x.dtype}")
    print(f"output {y.shape} {y.dtype}  (FP32 call {1e3 * (t1 - t0):.2f} ms)")
    print(f"  first row, first 4 values: {np.array2string(y[0, :4], precision=5)}")
    print(f"BF16 call {1e3 * (t2 - t1):.2f} ms, max |bf16 - fp32| / max |fp32| = {rel:.2e}")
    return 0 if y.shape == x.shape and np.isfinite(y).all() else 1


def shared_memory_calls(a, token, ca, hidden, x):
    client = epserve_client.Client(a.target, a.model, token=token, root_certificates=ca)
    ok = True
    try:
        with client.shared_memory_rows(a.tokens, hidden) as region:
            for datatype in ("FP32", "BF16"):
                t0 = time.perf_counter()
                y = client.infer(x, datatype=datatype, layer=a.layer, shared_memory=region)
                t1 = time.perf_counter()
                inline = client.infer(x, datatype=datatype, layer=a.layer)
                same = np.array_equal(y, inline)
                ok = ok and same and y.shape == x.shape
                print(f"{datatype} through shared memory region {region.name}: {y.shape}, "
                      f"{1e3 * (t1 - t0):.2f} ms, "
                      f"{'identical to' if same else 'DIFFERENT from'} the inline answer")
    finally:
        client.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
