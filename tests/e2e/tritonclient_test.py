"""The front-end through the unmodified tritonclient[grpc] package from PyPI.

tritonclient is installed into a virtual environment in the build tree (EPSERVE_TRITON_VENV,
made with /usr/bin/python3 -m venv --system-site-packages) the first time. Where the package
index cannot be reached, the test prints why and exits 77, which ctest reports as skipped.
"""

import os
import subprocess
import sys
import threading
import time

SKIP = 77


def skip(why):
    print(f"SKIPPED: tritonclient[grpc] test: {why}", flush=True)
    sys.exit(SKIP)


def ensure_tritonclient():
    """Returns when tritonclient.grpc imports here; else re-executes in the venv."""
    try:
        import tritonclient.grpc  # noqa: F401
        return
    except ImportError:
        pass
    if os.environ.get("EPSERVE_IN_TRITON_VENV"):
        skip("tritonclient is not importable even inside the virtual environment")
    venv = os.environ.get("EPSERVE_TRITON_VENV")
    if not venv:
        skip("EPSERVE_TRITON_VENV is not set")
    python = os.path.join(venv, "bin", "python3")
    probe = [python, "-c", "import tritonclient.grpc"]
    if not (os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0):
        try:
            if not os.path.exists(python):
                subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                               check=True, capture_output=True, timeout=120)
            r = subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check",
                                "-q", "--timeout", "20", "tritonclient[grpc]"],
                               capture_output=True, text=True, timeout=300)
        except (subprocess.SubprocessError, OSError) as e:
            skip(f"cannot create the virtual environment or install: {e}")
        if r.returncode != 0:
            skip("pip install tritonclient[grpc] failed (is the package index reachable?):\n"
                 + r.stderr[-1500:])
    os.environ["EPSERVE_IN_TRITON_VENV"] = "1"
    os.execv(python, [python] + sys.argv)


ensure_tritonclient()

import unittest  # noqa: E402

import numpy as np  # noqa: E402
import tritonclient.grpc as triton  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from epserve_cluster import Cluster  # noqa: E402

H = 64  # synthetic:tiny


class TritonClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(2, ["--max-batch-tokens=16"])
        cls.client = triton.InferenceServerClient(cls.cluster.address)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.cluster.stop()

    def infer(self, x, datatype, **kwargs):
        inp = triton.InferInput("hidden_states", list(x.shape), datatype)
        inp.set_data_from_numpy(x)
        out = triton.InferRequestedOutput("moe_output")
        return self.client.infer("moe", [inp], outputs=[out], **kwargs)

    def test_health_and_metadata(self):
        self.assertTrue(self.client.is_server_live())
        self.assertTrue(self.client.is_server_ready())
        self.assertTrue(self.client.is_model_ready("moe"))
        meta = self.client.get_model_metadata("moe", as_json=True)
        self.assertEqual(meta["inputs"][0]["name"], "hidden_states")
        self.assertEqual(meta["inputs"][0]["shape"], ["-1", str(H)])
        config = self.client.get_model_config("moe", as_json=True)["config"]
        self.assertEqual(config["name"], "moe")
        self.assertIn("dynamic_batching", config)
        self.assertIn("model_configuration", self.client.get_server_metadata().extensions)

    def test_infer_fp32_and_bf16(self):
        rng = np.random.default_rng(0)
        x = rng.uniform(-1, 1, size=(9, H)).astype(np.float32)
        r32 = self.infer(x, "FP32", request_id="a", priority=1, timeout=10_000_000)
        self.assertEqual(r32.get_response().id, "a")
        y32 = r32.as_numpy("moe_output")
        self.assertEqual(y32.shape, (9, H))
        self.assertEqual(y32.dtype, np.float32)
        self.assertTrue(np.isfinite(y32).all())
        # tritonclient since r26.06 takes and returns BF16 as ml_dtypes.bfloat16 arrays; older
        # releases as float32 (truncated on the way in).
        try:
            import ml_dtypes
            xb = x.astype(ml_dtypes.bfloat16)
        except ImportError:
            xb = x
        yb = self.infer(xb, "BF16").as_numpy("moe_output").astype(np.float32)
        self.assertEqual(yb.shape, (9, H))
        self.assertLess(np.abs(yb - y32).max() / np.abs(y32).max(), 3e-2)
        stats = self.client.get_inference_statistics("moe", as_json=True)
        self.assertGreaterEqual(int(stats["model_stats"][0]["inference_count"]), 2)


    def test_model_repository_unload_and_load(self):
        self.assertIn("model_repository", self.client.get_server_metadata().extensions)
        index = self.client.get_model_repository_index(as_json=True)["models"]
        self.assertEqual(index, [{"name": "moe", "version": "1", "state": "READY"}])
        x = np.random.default_rng().uniform(-1, 1, size=(5, H)).astype(np.float32)
        before = self.infer(x, "FP32").as_numpy("moe_output")
        self.client.unload_model("moe")
        try:
            self.assertFalse(self.client.is_model_ready("moe"))
            self.assertTrue(self.client.is_server_ready())
            (entry,) = self.client.get_model_repository_index(as_json=True)["models"]
            self.assertEqual(entry["state"], "UNAVAILABLE")
            self.assertIn("RepositoryModelUnload", entry["reason"])
            with self.assertRaises(InferenceServerException) as e:
                self.infer(x, "FP32")
            self.assertEqual(e.exception.status(), "StatusCode.NOT_FOUND")
            self.assertIn("unloaded", e.exception.message())
            with self.assertRaises(InferenceServerException) as e:
                self.client.load_model("moe", config='{"max_batch_size": 4}')
            self.assertEqual(e.exception.status(), "StatusCode.INVALID_ARGUMENT")
            self.assertIn("'max_batch_size' is unknown", e.exception.message())
            with self.assertRaises(InferenceServerException) as e:
                self.client.load_model("moe", files={"file:1/model.safetensors": b"x"})
            self.assertEqual(e.exception.status(), "StatusCode.UNIMPLEMENTED")
            with self.assertRaises(InferenceServerException) as e:
                self.client.unload_model("not-served")
            self.assertIn("unknown model 'not-served'", e.exception.message())
        finally:
            self.client.load_model("moe")
        self.assertTrue(self.client.is_model_ready("moe"))
        out = np.full_like(before, np.nan)
        out[:] = self.infer(x, "FP32").as_numpy("moe_output")
        np.testing.assert_array_equal(out, before)
        # New weights through Triton's `config` parameter, then the started ones again.
        self.client.load_model("moe", config='{"model": "synthetic:tiny", "seed": 5}')
        self.assertFalse(np.array_equal(self.infer(x, "FP32").as_numpy("moe_output"), before))
        self.client.load_model("moe", config='{"model": "synthetic:tiny", "seed": 0}')
        np.testing.assert_array_equal(self.infer(x, "FP32").as_numpy("moe_output"), before)

    def test_cuda_shared_memory_is_refused_with_the_reason(self):
        # CPU workers (and a build without the CUDA driver API) cannot reach CUDA memory.
        import base64
        handle = base64.b64encode(bytes(64))
        for call in (self.client.get_cuda_shared_memory_status,
                     lambda: self.client.register_cuda_shared_memory("r", handle, 0, 64),
                     lambda: self.client.unregister_cuda_shared_memory("r")):
            with self.assertRaises(InferenceServerException) as e:
                call()
            self.assertEqual(e.exception.status(), "StatusCode.UNIMPLEMENTED")
            self.assertIn("CUDA shared memory is not served here", e.exception.message())
            self.assertIn("register system shared memory instead", e.exception.message())
        self.assertNotIn("cuda_shared_memory", self.client.get_server_metadata().extensions)


class SharedMemoryCluster(unittest.TestCase):
    """A cluster started with ARGS, and regions made through tritonclient.utils.shared_memory,
    destroyed at the end."""
    ARGS = []
    RANKS = 2  # rank 0 and one worker

    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(cls.RANKS, cls.ARGS)
        cls.client = triton.InferenceServerClient(cls.cluster.address)
        cls.rng = np.random.default_rng()
        cls.handles = []

    @classmethod
    def tearDownClass(cls):
        cls.client.unregister_system_shared_memory()
        for h in cls.handles:
            try:
                shm.destroy_shared_memory_region(h)
            except (FileNotFoundError, shm.SharedMemoryException):
                pass  # unlinked by the test
        cls.client.close()
        cls.cluster.stop()

    def region(self, name, byte_size):
        key = f"/epserve_test_{os.getpid()}_{name}"
        h = shm.create_shared_memory_region(name, key, byte_size)
        self.handles.append(h)
        return h, key

    def infer_shm(self, tokens, datatype, in_name, in_size, out_name, out_size, in_offset=0,
                  out_offset=0):
        inp = triton.InferInput("hidden_states", [tokens, H], datatype)
        inp.set_shared_memory(in_name, in_size, in_offset)
        out = triton.InferRequestedOutput("moe_output")
        out.set_shared_memory(out_name, out_size, out_offset)
        return self.client.infer("moe", [inp], outputs=[out])


class SharedMemory(SharedMemoryCluster):
    """Triton's system shared-memory extension through tritonclient.utils.shared_memory."""
    ARGS = ["--max-batch-tokens=16"]

    def infer_inline(self, raw, tokens, datatype):
        """The same request with the input inline, raw bytes in and out."""
        inp = triton.InferInput("hidden_states", [tokens, H], datatype)
        inp._raw_content = raw  # (set_data_from_numpy would need ml_dtypes for BF16)
        return self.client.infer("moe", [inp]).get_response().raw_output_contents[0]

    def test_round_trips_are_bit_identical_to_inline(self):
        for datatype, width in (("FP32", 4), ("FP16", 2), ("BF16", 2)):
            tokens = 11
            x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
            if datatype == "FP16":
                raw = x.astype(np.float16).tobytes()
            elif datatype == "BF16":
                raw = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            else:
                raw = x.tobytes()
            n = tokens * H * width
            hin, _ = self.region(f"in_{datatype}", n + 64)
            hout, _ = self.region(f"out_{datatype}", n + 128)
            shm.set_shared_memory_region(hin, [np.frombuffer(raw, dtype=np.uint8)], offset=64)
            poison = np.full(n + 128, 0xAB, dtype=np.uint8)
            shm.set_shared_memory_region(hout, [poison])
            self.client.register_system_shared_memory(f"in_{datatype}", hin._shm_key, n + 64)
            self.client.register_system_shared_memory(f"out_{datatype}", hout._shm_key, n + 128)
            r = self.infer_shm(tokens, datatype, f"in_{datatype}", n, f"out_{datatype}", n,
                               in_offset=64, out_offset=128)
            out = r.get_response().outputs[0]
            self.assertEqual(list(out.shape), [tokens, H])
            self.assertEqual(out.datatype, datatype)
            self.assertEqual(len(r.get_response().raw_output_contents[0]), 0)
            got = shm.get_contents_as_numpy(hout, np.uint8, [n + 128]).tobytes()
            self.assertEqual(got[:128], bytes([0xAB]) * 128, "bytes before the offset touched")
            self.assertEqual(got[128:], self.infer_inline(raw, tokens, datatype), datatype)

    def test_bad_regions_are_clear_errors(self):
        tokens, n = 4, 4 * H * 4
        h, key = self.region("small", n)
        shm.set_shared_memory_region(h, [np.zeros(tokens * H, dtype=np.float32)])
        self.client.register_system_shared_memory("small", key, n)
        cases = {
            "too small": dict(in_size=n - 4),  # byte_size not the tensor's
            "past the end": dict(in_offset=8),
        }
        for what, kw in cases.items():
            args = dict(in_name="small", in_size=n, out_name="small", out_size=n)
            args.update(kw)
            with self.assertRaises(InferenceServerException, msg=what) as e:
                self.infer_shm(tokens, "FP32", **args)
            self.assertEqual(e.exception.status(), "StatusCode.INVALID_ARGUMENT", what)
        with self.assertRaises(InferenceServerException) as e:
            self.infer_shm(tokens, "FP32", "nobody", n, "small", n)
        self.assertEqual(e.exception.status(), "StatusCode.NOT_FOUND")
        self.assertIn("no shared memory region 'nobody'", e.exception.message())
        with self.assertRaises(InferenceServerException) as e:  # no such key
            self.client.register_system_shared_memory("ghost", "/epserve_no_such_key", 64)
        self.assertIn("cannot open key", e.exception.message())
        with self.assertRaises(InferenceServerException) as e:  # bigger than the object
            self.client.register_system_shared_memory("big", key, n + 1)
        self.assertIn("past the end", e.exception.message())
        with self.assertRaises(InferenceServerException) as e:  # the name is taken
            self.client.register_system_shared_memory("small", key, n)
        self.assertEqual(e.exception.status(), "StatusCode.ALREADY_EXISTS")
        status = self.client.get_system_shared_memory_status("small", as_json=True)
        self.assertEqual(int(status["regions"]["small"]["byte_size"]), n)
        # The owner shrinks the object: a clear error, the server goes on.
        shrunk = os.open("/dev/shm" + key, os.O_RDWR)
        os.ftruncate(shrunk, 16)
        os.close(shrunk)
        with self.assertRaises(InferenceServerException) as e:
            self.infer_shm(tokens, "FP32", "small", n, "small", n)
        self.assertIn("shrunk", e.exception.message())
        # Unregistered: its name is unknown again; the server still answers inline.
        self.client.unregister_system_shared_memory("small")
        with self.assertRaises(InferenceServerException) as e:
            self.infer_shm(tokens, "FP32", "small", n, "small", n)
        self.assertEqual(e.exception.status(), "StatusCode.NOT_FOUND")
        x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
        self.assertEqual(len(self.infer_inline(x.tobytes(), tokens, "FP32")), n)

    def test_a_region_unlinked_by_its_owner_keeps_working_while_registered(self):
        tokens, n = 3, 3 * H * 4
        h, key = self.region("unlinked", 2 * n)
        x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
        shm.set_shared_memory_region(h, [x])
        self.client.register_system_shared_memory("unlinked", key, 2 * n)
        os.unlink("/dev/shm" + key)
        r = self.infer_shm(tokens, "FP32", "unlinked", n, "unlinked", n, out_offset=n)
        self.assertEqual(len(r.get_response().raw_output_contents[0]), 0)
        got = shm.get_contents_as_numpy(h, np.uint8, [2 * n]).tobytes()[n:]
        self.assertEqual(got, self.infer_inline(x.tobytes(), tokens, "FP32"))
        self.client.unregister_system_shared_memory("unlinked")



class SharedMemoryReadByWorkers(SharedMemory):
    """The same, with the workers reading the regions and writing the answers themselves
    (--workers-read-shm=on; rank 0 copies none of these rows), bit for bit as rank 0's copies;
    two workers, so that the rows they take also go through the exchange."""
    ARGS = SharedMemory.ARGS + ["--workers-read-shm=on"]
    RANKS = 3

    def test_the_workers_take_the_rows(self):
        tokens, n = 7, 7 * H * 4
        h, key = self.region("counted", 2 * n)
        x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
        shm.set_shared_memory_region(h, [x, np.full(tokens * H, np.nan, np.float32)])
        self.client.register_system_shared_memory("counted", key, 2 * n)
        counter = "epserve_rows_read_by_workers_total"
        before = self.cluster.metric_sum(counter)
        r = self.infer_shm(tokens, "FP32", "counted", n, "counted", n, out_offset=n)
        self.assertEqual(len(r.get_response().raw_output_contents[0]), 0)
        self.assertEqual(self.cluster.metric_sum(counter), before + tokens)
        got = shm.get_contents_as_numpy(h, np.uint8, [2 * n]).tobytes()[n:]
        self.assertEqual(got, self.infer_inline(x.tobytes(), tokens, "FP32"))
        self.assertEqual(self.cluster.metric_sum(counter), before + tokens, "inline rows counted")
        self.client.unregister_system_shared_memory("counted")

    def test_concurrent_clients_get_their_own_answers(self):
        """Batches that start while another runs have their rows copied by rank 0, the others
        are taken by the workers; each answer is the inline one either way."""
        tokens, n, clients, rounds = 9, 9 * H * 4, 4, 6
        xs = [[self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
               for _ in range(rounds)] for _ in range(clients)]
        handles = []
        for c in range(clients):
            h, key = self.region(f"client{c}", 2 * n)
            self.client.register_system_shared_memory(f"client{c}", key, 2 * n)
            handles.append(h)
        got = [[None] * rounds for _ in range(clients)]

        def run(c):
            client = triton.InferenceServerClient(self.cluster.address)
            for r in range(rounds):
                shm.set_shared_memory_region(handles[c], [xs[c][r], np.full(tokens * H, np.nan,
                                                                            np.float32)])
                inp = triton.InferInput("hidden_states", [tokens, H], "FP32")
                inp.set_shared_memory(f"client{c}", n)
                out = triton.InferRequestedOutput("moe_output")
                out.set_shared_memory(f"client{c}", n, n)
                client.infer("moe", [inp], outputs=[out])
                got[c][r] = shm.get_contents_as_numpy(handles[c], np.uint8, [2 * n]).tobytes()[n:]
            client.close()
        threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in range(clients):
            for r in range(rounds):
                self.assertEqual(got[c][r], self.infer_inline(xs[c][r].tobytes(), tokens, "FP32"),
                                 f"client {c}, request {r}")
            self.client.unregister_system_shared_memory(f"client{c}")


class HeldInTheQueue(SharedMemoryCluster):
    """Regions changed while a request that uses them waits in rank 0's queue. This cluster
    forms a batch only once BATCH rows of a layer are queued, or once the oldest request has
    waited --max-queue-delay-us (HOLD_S, the bound of a hold): a smaller request waits in the
    queue until the test sends the rows that fill its batch."""
    BATCH = 128
    HOLD_S = 120
    ARGS = [f"--max-batch-tokens={BATCH}", f"--max-queue-delay-us={HOLD_S * 1_000_000}"]

    def held(self, tokens, name, n, change, x):
        """Sends a request of `tokens` rows (in and out through region `name`, its first `n`
        bytes), calls `change()` once /metrics shows its rows queued, then sends `x` inline, the
        BATCH - tokens rows that fill its batch; returns the held request's (result, error) and
        the inline answer's rows, computed in the same batch."""
        self.assertEqual(len(x), self.BATCH - tokens)
        inp = triton.InferInput("hidden_states", [tokens, H], "FP32")
        inp.set_shared_memory(name, n)
        out = triton.InferRequestedOutput("moe_output")
        out.set_shared_memory(name, n)
        answer = []  # (tritonclient calls back with keywords result= and error=)
        self.client.async_infer("moe", [inp], lambda result, error: answer.append((result, error)),
                                outputs=[out])
        # (the gauge is set as the request is queued: nothing else is queued or runs meanwhile)
        queued_by = time.time() + 30
        while (self.cluster.metric_sum("epserve_queue_tokens") != tokens and not answer
               and time.time() < queued_by):
            time.sleep(0.01)
        self.assertFalse(answer, "answered while it should have waited for a full batch")
        self.assertEqual(self.cluster.metric_sum("epserve_queue_tokens"), tokens,
                         "the request's rows were not queued within 30 s")
        change()
        filler = triton.InferInput("hidden_states", list(x.shape), "FP32")
        filler.set_data_from_numpy(x)
        inline = self.client.infer("moe", [filler]).as_numpy("moe_output")
        answered_by = time.time() + 60
        while not answer and time.time() < answered_by:
            time.sleep(0.01)
        self.assertTrue(answer, "the held request was not answered within 60 s of its batch")
        return answer[0], inline

    def test_unregistered_and_unlinked_while_queued_still_answers(self):
        tokens, n = 5, 5 * H * 4
        h, key = self.region("queued", 2 * n)
        x = self.rng.uniform(-1, 1, size=(self.BATCH - tokens, H)).astype(np.float32)
        shm.set_shared_memory_region(h, [x[:tokens], np.full(tokens * H, np.nan, np.float32)])
        self.client.register_system_shared_memory("queued", key, 2 * n)

        def change():
            self.client.unregister_system_shared_memory("queued")
            os.unlink("/dev/shm" + key)
        (result, error), inline = self.held(tokens, "queued", n, change, x)
        self.assertIsNone(error)
        # (the output went to the region's first n bytes, over the input: read it back, and
        # compare it with the same rows sent inline in the same batch)
        got = shm.get_contents_as_numpy(h, np.float32, [tokens, H])
        np.testing.assert_array_equal(got, inline[:tokens])

    def test_a_region_shrunk_while_queued_is_an_error_not_a_crash(self):
        # 4 pages: the accesses past the new end of the object fault (SIGBUS but for the
        # server's handler), except within its first page (zeros, no fault)
        tokens, n = 64, 64 * H * 4
        h, key = self.region("shrinking", n)
        shm.set_shared_memory_region(h, [self.rng.uniform(-1, 1, size=(tokens, H))
                                         .astype(np.float32)])
        self.client.register_system_shared_memory("shrinking", key, n)

        def change():
            fd = os.open("/dev/shm" + key, os.O_RDWR)
            os.ftruncate(fd, 16)
            os.close(fd)
        x = self.rng.uniform(-1, 1, size=(self.BATCH - tokens, H)).astype(np.float32)
        (result, error), inline = self.held(tokens, "shrinking", n, change, x)
        self.assertIsNotNone(error, "an answer from a region its owner had shrunk")
        self.assertEqual(error.status(), "StatusCode.INVALID_ARGUMENT")
        self.assertIn("shrunk by its owner while in use", error.message())
        self.assertTrue(np.isfinite(inline).all(), "the request in the same batch")
        # Rank 0 lives on: the region is refused from now on, other requests are answered.
        with self.assertRaises(InferenceServerException) as e:
            self.infer_shm(tokens, "FP32", "shrinking", n, "shrinking", n)
        self.assertIn("shrunk", e.exception.message())
        self.client.unregister_system_shared_memory("shrinking")
        full = self.rng.uniform(-1, 1, size=(self.BATCH, H)).astype(np.float32)
        inp = triton.InferInput("hidden_states", list(full.shape), "FP32")
        inp.set_data_from_numpy(full)
        self.assertEqual(self.client.infer("moe", [inp]).as_numpy("moe_output").shape, full.shape)
        self.assertTrue(self.client.is_server_ready())


class HeldInTheQueueReadByWorkers(HeldInTheQueue):
    """The same with the workers reading and writing the regions (--workers-read-shm=on): a
    region shrunk under its batch reads as zeros there, and rank 0 answers that request, and
    only it, with the error."""
    ARGS = HeldInTheQueue.ARGS + ["--workers-read-shm=on"]


if __name__ == "__main__":
    sys.exit(unittest.main(verbosity=2))
