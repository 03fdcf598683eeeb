"""KServe's CUDA shared memory through the unmodified tritonclient: the client's rows stay in
its GPU memory (tritonclient.utils.cuda_shared_memory, which needs cuda-python's
cuda.bindings), the GPU workers read them and write the answer there.

Needs a CUDA GPU, GPU workers and cuda.bindings: run by bench/gpu/run_gpu_bench.py on a GPU host
(EPSERVE_BINARY, EPSERVE_GPU_WORKERS for the number of workers, one per GPU, and
EPSERVE_CUDA_SHM_ARGS for more server flags, such as --weight-dtype=bf16 for the tensor-core
path). Anywhere
else it prints why and exits 77 (skipped). On CPU workers the extension answers UNIMPLEMENTED,
which tritonclient_test checks.
"""

import base64
import os
import sys
import time

SKIP = 77


def skip(why):
    print(f"SKIPPED: CUDA shared memory test: {why}", flush=True)
    sys.exit(SKIP)


try:
    import numpy as np
    import tritonclient.grpc as triton
    import tritonclient.utils.cuda_shared_memory as cudashm
    from tritonclient.utils import InferenceServerException
except ImportError as e:
    skip(f"tritonclient with cuda.bindings is not importable: {e}")
if not os.environ.get("EPSERVE_BINARY"):
    skip("EPSERVE_BINARY is not set")

import unittest  # noqa: E402

from epserve_cluster import Cluster  # noqa: E402

H = 64  # synthetic:tiny
K = 2
WORKERS = int(os.environ.get("EPSERVE_GPU_WORKERS", "1"))
WIDTH = {"FP32": 4, "FP16": 2, "BF16": 2}


def raw_rows(x, datatype):
    """FP32 rows x as the raw little-endian bytes of `datatype` (BF16: the top halves)."""
    if datatype == "FP16":
        return np.frombuffer(x.astype(np.float16).tobytes(), np.uint8)
    if datatype == "BF16":
        return np.frombuffer((x.view(np.uint32) >> 16).astype(np.uint16).tobytes(), np.uint8)
    return np.frombuffer(x.tobytes(), np.uint8)


class CudaSharedMemory(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        extra = os.environ.get("EPSERVE_CUDA_SHM_ARGS", "").split()  # e.g. --weight-dtype=bf16
        cls.cluster = Cluster(1 + WORKERS, ["--device=gpu", "--max-batch-tokens=64", *extra])
        cls.client = triton.InferenceServerClient(cls.cluster.address)
        cls.rng = np.random.default_rng()
        cls.handles = {}

    @classmethod
    def tearDownClass(cls):
        if os.environ.get("EPSERVE_TEST_LOG"):
            print("---- server log (tail) ----\n" + cls.cluster.read_log()[-6000:], flush=True)
        try:
            cls.client.unregister_cuda_shared_memory()
        finally:
            for h in cls.handles.values():
                cudashm.destroy_shared_memory_region(h)
            cls.client.close()
            cls.cluster.stop()

    def region(self, name, nbytes, device=0):
        h = cudashm.create_shared_memory_region(name, nbytes, device)
        self.handles[name] = h
        self.client.register_cuda_shared_memory(name, cudashm.get_raw_handle(h), device, nbytes)
        return h

    def drop(self, name):
        self.client.unregister_cuda_shared_memory(name)
        cudashm.destroy_shared_memory_region(self.handles.pop(name))

    def rows(self, tokens, datatype):
        """Fresh random rows as raw bytes of `datatype`."""
        x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
        return raw_rows(x, datatype)

    def infer_inline(self, raw, tokens, datatype, out_type):
        """The same request with the input inline: the answer's raw bytes."""
        inp = triton.InferInput("hidden_states", [tokens, H], datatype)
        inp._raw_content = raw.tobytes()
        out = triton.InferRequestedOutput("moe_output")
        out._output.parameters["datatype"].string_param = out_type
        r = self.client.infer("moe", [inp], outputs=[out])
        return np.frombuffer(r.get_response().raw_output_contents[0], np.uint8)

    def infer_cuda(self, tokens, datatype, in_name, in_bytes, out_name, out_bytes, out_type,
                   in_offset=0, out_offset=0):
        inp = triton.InferInput("hidden_states", [tokens, H], datatype)
        inp.set_shared_memory(in_name, in_bytes, in_offset)
        out = triton.InferRequestedOutput("moe_output")
        out._output.parameters["datatype"].string_param = out_type
        out.set_shared_memory(out_name, out_bytes, out_offset)
        return self.client.infer("moe", [inp], outputs=[out])

    def test_extension_and_status(self):
        self.assertIn("cuda_shared_memory", self.client.get_server_metadata().extensions)
        self.region("status_a", 4096)
        status = self.client.get_cuda_shared_memory_status("status_a", as_json=True)
        region = status["regions"]["status_a"]
        self.assertEqual(int(region["byte_size"]), 4096)
        self.assertEqual(int(region.get("device_id", 0)), 0)
        self.drop("status_a")
        with self.assertRaises(InferenceServerException) as e:
            self.client.get_cuda_shared_memory_status("status_a")
        self.assertEqual(e.exception.status(), "StatusCode.NOT_FOUND")

    def test_rows_in_and_out_of_gpu_memory_match_inline(self):
        for datatype, out_type in (("FP32", "FP32"), ("BF16", "BF16"), ("FP16", "FP32"),
                                   ("FP32", "FP16")):
            with self.subTest(datatype=datatype, out_type=out_type):
                tokens = int(self.rng.integers(1, 40))
                raw = self.rows(tokens, datatype)
                out_bytes = tokens * H * WIDTH[out_type]
                # Both at an offset inside larger regions, the output poisoned first.
                name_in, name_out = "in_" + datatype + out_type, "out_" + datatype + out_type
                hi = self.region(name_in, raw.nbytes + 512)
                ho = self.region(name_out, out_bytes + 1024)
                cudashm.set_shared_memory_region(hi, [np.zeros(512, np.uint8), raw])
                cudashm.set_shared_memory_region(ho, [np.full(out_bytes + 1024, 0xAB, np.uint8)])
                r = self.infer_cuda(tokens, datatype, name_in, raw.nbytes, name_out, out_bytes,
                                    out_type, in_offset=512, out_offset=256)
                self.assertEqual(r.get_response().outputs[0].datatype, out_type)
                self.assertEqual(len(r.get_response().raw_output_contents[0]), 0)
                got = cudashm.get_contents_as_numpy(ho, np.uint8, [out_bytes + 1024])
                want = self.infer_inline(raw, tokens, datatype, out_type)
                self.assertEqual(got[256:256 + out_bytes].tobytes(), want.tobytes())
                self.assertTrue((got[:256] == 0xAB).all(), "bytes before the offset touched")
                self.assertTrue((got[256 + out_bytes:] == 0xAB).all(), "bytes after touched")
                self.drop(name_in)
                self.drop(name_out)

    def test_mixed_batches_of_cuda_and_inline_requests(self):
        n = 12
        tokens = [int(self.rng.integers(1, 9)) for _ in range(n)]
        raws = [self.rows(t, "FP32") for t in tokens]
        want = [self.infer_inline(raws[i], tokens[i], "FP32", "FP32") for i in range(n)]
        outs_cuda = {}
        for i in range(0, n, 2):
            hi = self.region(f"mi{i}", raws[i].nbytes)
            outs_cuda[i] = self.region(f"mo{i}", raws[i].nbytes)
            cudashm.set_shared_memory_region(hi, [raws[i]])
            cudashm.set_shared_memory_region(outs_cuda[i], [np.full(raws[i].nbytes, 0xAB, np.uint8)])
        done = []
        for i in range(n):
            inp = triton.InferInput("hidden_states", [tokens[i], H], "FP32")
            out = triton.InferRequestedOutput("moe_output")
            if i % 2:
                inp._raw_content = raws[i].tobytes()
            else:
                inp.set_shared_memory(f"mi{i}", raws[i].nbytes)
                out.set_shared_memory(f"mo{i}", raws[i].nbytes)
            # (tritonclient calls back with the keywords result= and error=)
            self.client.async_infer(
                "moe", [inp], lambda result, error, i=i: done.append((i, result, error)),
                outputs=[out], client_timeout=30)
        deadline = time.time() + 30
        while len(done) < n and time.time() < deadline:
            time.sleep(0.01)
        self.assertEqual(len(done), n, f"answered: {sorted(i for i, _, _ in done)}")
        for i, r, e in done:
            self.assertIsNone(e, f"request {i}: {e}")
            if i % 2:
                got = np.frombuffer(r.get_response().raw_output_contents[0], np.uint8)
            else:
                got = cudashm.get_contents_as_numpy(outs_cuda[i], np.uint8, [raws[i].nbytes])
            # Batched with others: the same values up to the order of a sum.
            np.testing.assert_allclose(got.view(np.float32), want[i].view(np.float32), rtol=1e-5,
                                       atol=1e-6, err_msg=f"request {i}")
        for i in range(0, n, 2):
            self.drop(f"mi{i}")
            self.drop(f"mo{i}")

    def expect_error(self, status, text, call):
        with self.assertRaises(InferenceServerException) as e:
            call()
        self.assertEqual(e.exception.status(), status, e.exception.message())
        self.assertIn(text, e.exception.message())

    def test_bad_registrations_name_the_field(self):
        good = cudashm.create_shared_memory_region("bad_base", 4096, 0)
        self.handles["bad_base"] = good
        raw = cudashm.get_raw_handle(good)
        junk = base64.b64encode(bytes(self.rng.integers(0, 256, 64, dtype=np.uint8)))
        reg = self.client.register_cuda_shared_memory
        self.expect_error("StatusCode.INVALID_ARGUMENT", "could not be opened",
                          lambda: reg("junk", junk, 0, 64))
        self.expect_error("StatusCode.INVALID_ARGUMENT", "device_id 99",
                          lambda: reg("far", raw, 99, 64))
        self.expect_error("StatusCode.INVALID_ARGUMENT", "byte_size",
                          lambda: reg("big", raw, 0, 1 << 40))
        self.expect_error("StatusCode.INVALID_ARGUMENT", "raw_handle",
                          lambda: reg("short", base64.b64encode(b"x" * 8), 0, 64))
        reg("bad_base", raw, 0, 4096)
        self.expect_error("StatusCode.ALREADY_EXISTS", "registered already",
                          lambda: reg("bad_base", raw, 0, 4096))
        # A request past the region's end, or with the routing in CUDA memory.
        self.expect_error("StatusCode.INVALID_ARGUMENT", "shared_memory_byte_size",
                          lambda: self.infer_cuda(32, "FP32", "bad_base", 100, "bad_base",
                                                  32 * H * 4, "FP32"))
        self.expect_error("StatusCode.INVALID_ARGUMENT", "lie outside",
                          lambda: self.infer_cuda(32, "FP32", "bad_base", 32 * H * 4, "bad_base",
                                                  32 * H * 4, "FP32"))
        self.expect_error("StatusCode.INVALID_ARGUMENT", "lie outside",
                          lambda: self.infer_cuda(4, "FP32", "bad_base", 4 * H * 4, "bad_base",
                                                  4 * H * 4, "FP32", in_offset=4000))
        inp = triton.InferInput("hidden_states", [1, H], "FP32")
        inp.set_shared_memory("bad_base", H * 4)
        ids = triton.InferRequestedOutput("topk_ids")
        ids.set_shared_memory("bad_base", K * 4, 1024)
        self.expect_error("StatusCode.INVALID_ARGUMENT", "cannot go to CUDA shared memory",
                          lambda: self.client.infer("moe", [inp], outputs=[ids]))
        self.drop("bad_base")
        self.assertTrue(self.client.is_server_ready())

    def test_memory_freed_by_its_client_is_no_one_elses(self):
        # The client frees a registered allocation and makes a new one (which may take the same
        # addresses); a request naming the old region is answered, or refused, without a write
        # into the new one, and the server serves on.
        tokens = 8
        raw = self.rows(tokens, "FP32")
        h = self.region("freed", raw.nbytes)
        cudashm.set_shared_memory_region(h, [raw])
        cudashm.destroy_shared_memory_region(self.handles.pop("freed"))
        fresh = cudashm.create_shared_memory_region("fresh", raw.nbytes, 0)
        self.handles["fresh"] = fresh
        cudashm.set_shared_memory_region(fresh, [np.full(raw.nbytes, 0xAB, np.uint8)])
        try:
            self.infer_cuda(tokens, "FP32", "freed", raw.nbytes, "freed", raw.nbytes, "FP32")
            print("request on a freed allocation: answered")
        except InferenceServerException as e:
            print(f"request on a freed allocation: {e.status()}: {e.message()}")
        got = cudashm.get_contents_as_numpy(fresh, np.uint8, [raw.nbytes])
        self.assertTrue((got == 0xAB).all(), "the server wrote into the client's new allocation")
        self.client.unregister_cuda_shared_memory("freed")
        self.assertEqual(len(self.infer_inline(raw, tokens, "FP32", "FP32")), raw.nbytes)
        self.assertTrue(self.client.is_server_ready())


if __name__ == "__main__":
    sys.exit(unittest.main(verbosity=2))
