"""The front-end through the unmodified tritonclient[grpc] package from PyPI.

tritonclient is installed into a virtual environment in the build tree (EPSERVE_TRITON_VENV,
made with /usr/bin/python3 -m venv --system-site-packages) the first time. Where the package
index cannot be reached, the test prints why and exits 77, which ctest reports as skipped.
"""

import os
import subprocess
import sys
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


class SharedMemory(unittest.TestCase):
    """Triton's system shared-memory extension through tritonclient.utils.shared_memory."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(2, ["--max-batch-tokens=16"])
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

    def queued_behind_work(self, tokens, in_name, out_name, n, change):
        """Sends a shared-memory request behind 8 inline requests of 8192 tokens (4096 batches
        of 16 rows), calls `change()` once the server has accepted all nine (answered plus in
        flight, from /metrics; a fixed 0.2 s lost the race on a loaded host, where the 512 MiB
        ahead of it had not all arrived by then), while it is still queued, and returns its
        result or its error; None when it was answered before the change."""
        big = self.rng.uniform(-1, 1, size=(8192, H)).astype(np.float32)
        accepted_before = self.cluster.accepted()
        done = []
        for _ in range(8):
            inp = triton.InferInput("hidden_states", [8192, H], "FP32")
            inp.set_data_from_numpy(big)
            self.client.async_infer("moe", [inp], lambda result, error: done.append(error))
        inp = triton.InferInput("hidden_states", [tokens, H], "FP32")
        inp.set_shared_memory(in_name, n)
        out = triton.InferRequestedOutput("moe_output")
        out.set_shared_memory(out_name, n)
        answer = []
        self.client.async_infer("moe", [inp], lambda result, error: answer.append((result, error)),
                                outputs=[out])
        t0 = time.time()
        accepted_by = t0 + 30
        while (self.cluster.accepted() < accepted_before + 9 and not answer
               and time.time() < accepted_by):
            time.sleep(0.01)
        too_late = bool(answer)
        change()
        deadline = time.time() + 60
        while (not answer or len(done) < 8) and time.time() < deadline:
            time.sleep(0.01)
        print(f"(queued request answered {time.time() - t0:.2f} s after it was sent)",
              flush=True)
        self.assertEqual(done, [None] * 8, "the inline requests ahead")
        self.assertTrue(answer, "no answer within 60 s")
        return None if too_late else answer[0]

    def test_unregistered_and_unlinked_while_queued_still_answers(self):
        tokens, n = 5, 5 * H * 4
        for attempt in range(3):
            name = f"queued_{attempt}"
            h, key = self.region(name, 2 * n)
            x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
            shm.set_shared_memory_region(h, [x, np.full(tokens * H, np.nan, np.float32)])
            self.client.register_system_shared_memory(name, key, 2 * n)

            def change():
                self.client.unregister_system_shared_memory(name)
                os.unlink("/dev/shm" + key)
            answered = self.queued_behind_work(tokens, name, name, n, change)
            if answered is None:
                continue  # answered before the change: try again
            result, error = answered
            if error is not None and error.status() == "StatusCode.NOT_FOUND":
                continue  # unregistered before the server had the request: try again
            self.assertIsNone(error)
            # (the output went to the region's first n bytes, over the input: read it back)
            got = shm.get_contents_as_numpy(h, np.uint8, [n]).tobytes()
            self.assertEqual(got, self.infer_inline(x.tobytes(), tokens, "FP32"))
            return
        self.fail("3 tries: the request was never still queued when its region was unregistered")

    def test_a_region_shrunk_while_queued_is_an_error_not_a_crash(self):
        # 4 pages: the accesses past the new end of the object fault (SIGBUS but for the
        # server's handler), except within its first page (zeros, no fault)
        tokens, n = 64, 64 * H * 4
        for attempt in range(3):
            name = f"shrinking_{attempt}"
            h, key = self.region(name, n)
            shm.set_shared_memory_region(h, [self.rng.uniform(-1, 1, size=(tokens, H))
                                             .astype(np.float32)])
            self.client.register_system_shared_memory(name, key, n)

            def change():
                fd = os.open("/dev/shm" + key, os.O_RDWR)
                os.ftruncate(fd, 16)
                os.close(fd)
            answered = self.queued_behind_work(tokens, name, name, n, change)
            if answered is not None:
                break
            self.client.unregister_system_shared_memory(name)  # answered first: try again
        else:
            self.fail("3 tries: the request was never still queued when its region shrank")
        result, error = answered
        self.assertIsNotNone(error, "an answer from a region its owner had shrunk")
        self.assertEqual(error.status(), "StatusCode.INVALID_ARGUMENT")
        self.assertIn("shrunk by its owner while in use", error.message())
        # Rank 0 lives on: the region is refused from now on, other requests are answered.
        with self.assertRaises(InferenceServerException) as e:
            self.infer_shm(tokens, "FP32", name, n, name, n)
        self.assertIn("shrunk", e.exception.message())
        self.client.unregister_system_shared_memory(name)
        x = self.rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
        self.assertEqual(len(self.infer_inline(x.tobytes(), tokens, "FP32")), n)
        self.assertTrue(self.client.is_server_ready())


if __name__ == "__main__":
    sys.exit(unittest.main(verbosity=2))
