"""The front-end through Python's grpcio and the project's proto (client/python)."""

import sys
import threading
import time
import unittest

import grpc
import numpy as np

import epserve_client
from epserve_cluster import Cluster
from epserve_client import Client, InferError

H = 64  # synthetic:tiny


def reflection_services(channel, metadata=()):
    """Service names from grpc.reflection.v1alpha's ListServices, decoding the protobuf
    wire format by hand (Debian's grpcio has no reflection module)."""
    call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                 request_serializer=lambda b: b, response_deserializer=lambda b: b)
    request = b"\x3a\x00"  # field 7 (list_services) = ""

    def fields(buf):
        i = 0
        while i < len(buf):
            key, i = varint(buf, i)
            if key & 7 == 2:
                n, i = varint(buf, i)
                yield key >> 3, buf[i:i + n]
                i += n
            elif key & 7 == 0:
                _, i = varint(buf, i)
            else:
                raise ValueError("unexpected wire type")

    def varint(buf, i):
        v = shift = 0
        while True:
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v, i

    names = []
    for resp in call(iter([request]), timeout=10, metadata=metadata):
        for num, body in fields(resp):
            if num == 6:  # list_services_response
                for _, service in fields(body):
                    names += [v.decode() for n, v in fields(service) if n == 1]
    return names


class PythonClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(3, ["--max-batch-tokens=16", "--max-queue-delay-us=200"])
        cls.client = Client(cls.cluster.address)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.cluster.stop()

    def test_health_metadata_and_config(self):
        c = self.client
        self.assertTrue(c.live())
        self.assertTrue(c.ready())
        self.assertTrue(c.model_ready())
        self.assertEqual(c.health(), "SERVING")
        meta = c.model_metadata()
        self.assertEqual(meta.inputs[0].name, "hidden_states")
        self.assertEqual(list(meta.inputs[0].shape), [-1, H])
        self.assertEqual(list(meta.outputs[0].shape), [-1, H])
        self.assertIn("statistics", c.server_metadata().extensions)
        config = c.model_config()
        self.assertEqual(config.max_batch_size, 0)
        self.assertEqual(config.dynamic_batching.max_queue_delay_microseconds, 200)

    def test_fp32_bf16_fp16_agree(self):
        rng = np.random.default_rng(1)
        x = rng.uniform(-1, 1, size=(20, H)).astype(np.float32)
        y32 = self.client.infer(x)
        self.assertEqual(y32.shape, (20, H))
        np.testing.assert_array_equal(self.client.infer(x), y32)  # deterministic
        scale = np.abs(y32).max()
        for dt, tol in (("BF16", 3e-2), ("FP16", 5e-3)):
            y = self.client.infer(x, datatype=dt)
            err = np.abs(y - y32).max() / scale
            self.assertLess(err, tol, dt)
        y = self.client.infer(x, datatype="BF16", output_datatype="FP32")
        self.assertLess(np.abs(y - y32).max() / scale, 3e-2)

    def test_shared_memory_answers_match_inline(self):
        rng = np.random.default_rng()
        with self.client.shared_memory_rows(max_tokens=24, hidden=H) as region:
            self.assertIn(region.name, self.client.system_shared_memory_status())
            for tokens, dt, out_dt in ((24, "FP32", None), (7, "BF16", None),
                                       (5, "FP16", "FP32"), (1, "BF16", "BF16")):
                x = rng.uniform(-1, 1, size=(tokens, H)).astype(np.float32)
                region.shm.buf[:] = b"\xff" * len(region.shm.buf)  # poison: NaN in every dtype
                y = self.client.infer(x, datatype=dt, output_datatype=out_dt,
                                      shared_memory=region)
                inline = self.client.infer(x, datatype=dt, output_datatype=out_dt)
                np.testing.assert_array_equal(y, inline, err_msg=f"{tokens} {dt} -> {out_dt}")
            with self.assertRaises(ValueError):  # more rows than the region holds
                self.client.infer(np.zeros((25, H), np.float32), shared_memory=region)
            name = region.name
        self.assertNotIn(name, self.client.system_shared_memory_status())

    def test_unload_and_load_the_model(self):
        x = np.random.default_rng().uniform(-1, 1, size=(3, H)).astype(np.float32)
        before = self.client.infer(x)
        self.assertEqual(self.client.repository_index(), [("moe", "1", "READY", "")])
        self.client.unload_model()
        try:
            self.assertFalse(self.client.model_ready())
            self.assertEqual(self.client.health(), "SERVING")  # the server is fine
            self.assertEqual(self.client.repository_index()[0][2], "UNAVAILABLE")
            with self.assertRaises(InferError) as e:
                self.client.infer(x)
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        finally:
            self.client.load_model()
        self.assertTrue(self.client.model_ready())
        np.testing.assert_array_equal(self.client.infer(x), before)

    def test_errors_name_the_field(self):
        with self.assertRaises(InferError) as e:
            self.client.infer(np.zeros((2, H + 1), np.float32))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("shape[1] (hidden size) must be 64", e.exception.message)
        with self.assertRaises(InferError) as e:
            self.client.infer(np.zeros((2, H), np.float32), timeout_us=1)
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_stream_matches_answers_to_requests(self):
        rng = np.random.default_rng(2)
        xs = {f"r{i}": rng.uniform(-1, 1, size=(1 + i % 7, H)).astype(np.float32)
              for i in range(20)}
        reqs = [self.client.request(x, request_id=rid) for rid, x in xs.items()]
        reqs.append(self.client.request(np.zeros((1, H)), request_id="bad", layer=99))
        got = dict(self.client.stream_infer(reqs))
        self.assertEqual(set(got), set(xs) | {"bad"})
        self.assertIsInstance(got["bad"], InferError)
        self.assertIn("not a served MoE layer", got["bad"].message)
        for rid, x in xs.items():
            np.testing.assert_allclose(got[rid], self.client.infer(x), rtol=1e-5, atol=1e-6)

    def test_bf16_rows_round_to_nearest_even_or_go_as_stored(self):
        """encode: BF16 rounded to nearest even (ties to even, NaN kept NaN, overflow to inf),
        against the 64-bit formula; BF16 bits and FP16 values sent as they are; decode's
        as_stored returns them untouched. An answer asked as_stored is the float answer's bits."""
        rng = np.random.default_rng()
        x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
        special = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -1 - 2 ** -8, np.inf, -np.inf, 3.4e38, 1e-40,
                   -0.0, 0.0]
        x[:len(special)] = special
        x[-3:] = np.nan
        bits = x.view(np.uint32).astype(np.uint64)
        want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        got = np.frombuffer(epserve_client.encode(x, "BF16"), dtype="<u2")
        finite = ~np.isnan(x)
        np.testing.assert_array_equal(got[finite], want[finite])
        self.assertTrue(np.isnan(epserve_client.decode(got.tobytes(), "BF16", x.shape)[~finite])
                        .all())
        self.assertEqual(got[0], 0x3F80)  # 1 + 2^-8 ties to the even 1.0
        self.assertEqual(got[1], 0x3F82)  # 1 + 3 * 2^-8 ties to the even 1 + 2^-6
        self.assertEqual(got[5], 0x7F80)  # rounds past the largest BF16: inf
        self.assertEqual(epserve_client.encode(got, "BF16"), got.tobytes())
        h = x[:8].astype(np.float16)
        self.assertEqual(epserve_client.encode(h, "FP16"), h.tobytes())
        np.testing.assert_array_equal(
            epserve_client.decode(got.tobytes(), "BF16", x.shape, as_stored=True), got)
        rows = rng.uniform(-1, 1, size=(5, H)).astype(np.float32)
        as_float = self.client.infer(rows, datatype="BF16")
        row_bits = np.frombuffer(epserve_client.encode(rows, "BF16"), "<u2").reshape(rows.shape)
        as_bits = self.client.infer(row_bits, datatype="BF16", as_stored=True)
        self.assertEqual(as_bits.dtype, np.uint16)
        np.testing.assert_array_equal((as_bits.astype(np.uint32) << 16).view(np.float32),
                                      as_float)

    def test_one_stream_answers_each_request_in_turn(self):
        """InferStream: requests sent one after another over one stream, inline and through a
        shared-memory region, answered as unary calls answer them; an error ends nothing."""
        rng = np.random.default_rng()
        with self.client.shared_memory_rows(max_tokens=8, hidden=H, datatype="BF16") as region, \
                self.client.open_stream(timeout=30) as stream:
            for i in range(12):
                x = rng.uniform(-1, 1, size=(1 + i % 8, H)).astype(np.float32)
                shm = region if i % 2 else None
                if shm is not None:
                    region.shm.buf[:] = b"\xff" * len(region.shm.buf)  # poison
                y = stream.infer(x, datatype="BF16", shared_memory=shm)
                np.testing.assert_array_equal(y, self.client.infer(x, datatype="BF16"))
            with self.assertRaises(InferError) as e:
                stream.infer(np.zeros((1, H), np.float32), layer=99)
            self.assertIn("not a served MoE layer", e.exception.message)
            x = rng.uniform(-1, 1, size=(3, H)).astype(np.float32)
            np.testing.assert_array_equal(stream.infer(x), self.client.infer(x))

    def test_routing_outputs(self):
        """infer_routing: the answer with the router's top-k ids (distinct, in range) and
        weights, the same answer as without, inline and with moe_output in a region."""
        rng = np.random.default_rng()
        x = rng.uniform(-1, 1, size=(9, H)).astype(np.float32)
        y, ids, w = self.client.infer_routing(x)
        np.testing.assert_array_equal(y, self.client.infer(x))
        k = self.client.model_config().output[1].dims[-1]
        self.assertEqual(ids.shape, (9, k))
        self.assertEqual(w.shape, (9, k))
        for row in ids:
            self.assertEqual(len(set(row.tolist())), k)
        self.assertTrue(((ids >= 0) & (ids < 8)).all(), ids)
        self.assertTrue((w > 0).all(), w)
        with self.client.shared_memory_rows(max_tokens=9, hidden=H) as region:
            region.shm.buf[:] = b"\xff" * len(region.shm.buf)
            y2, ids2, w2 = self.client.infer_routing(x, shared_memory=region)
        np.testing.assert_array_equal(y2, y)
        np.testing.assert_array_equal(ids2, ids)
        np.testing.assert_array_equal(w2, w)

    def test_concurrent_clients(self):
        rng = np.random.default_rng(3)
        xs = [rng.uniform(-1, 1, size=(1 + i % 9, H)).astype(np.float32) for i in range(16)]
        want = [self.client.infer(x) for x in xs]
        got = [None] * len(xs)

        def run(i):
            got[i] = self.client.infer(xs[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    def test_reflection_lists_the_services(self):
        names = reflection_services(self.client.channel)
        self.assertIn("inference.GRPCInferenceService", names)
        self.assertIn("grpc.health.v1.Health", names)

    def test_statistics(self):
        self.client.infer(np.zeros((3, H), np.float32))
        s = self.client.model_statistics()
        self.assertGreater(s.inference_count, 0)
        self.assertGreater(s.execution_count, 0)
        self.assertEqual(s.inference_stats.queue.count, s.inference_stats.success.count)


class WeightSwap(unittest.TestCase):
    """RepositoryModelLoad with new weights while clients run: every answer is entirely the old
    weights' or the new ones', none fails, and failed loads leave the served weights."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(3, ["--max-batch-tokens=16", "--seed=3"])
        cls.client = Client(cls.cluster.address)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.cluster.stop()

    def answers(self, xs):
        return [self.client.infer(x) for x in xs]

    def test_swaps_under_load_give_whole_answers_and_lose_nothing(self):
        rng = np.random.default_rng()
        # Requests of 1 to 40 rows: those over 16 span several batches.
        xs = [rng.uniform(-1, 1, size=(n, H)).astype(np.float32) for n in (1, 5, 16, 23, 40, 9)]
        self.client.load_model("synthetic:tiny", seed=3)  # the weights it started with
        old = self.answers(xs)
        self.client.load_model("synthetic:tiny", seed=11)
        new = self.answers(xs)
        for a, b in zip(old, new):
            self.assertFalse(np.array_equal(a, b))
        stop = threading.Event()
        failures, counts = [], {"old": 0, "new": 0}
        lock = threading.Lock()

        def run():
            c = Client(self.cluster.address)
            try:
                i = 0
                while not stop.is_set():
                    j = i % len(xs)
                    i += 1
                    try:
                        y = c.infer(xs[j])
                    except InferError as e:
                        with lock:
                            failures.append(str(e))
                        continue
                    which = ("old" if np.array_equal(y, old[j])
                             else "new" if np.array_equal(y, new[j]) else None)
                    with lock:
                        if which is None:
                            failures.append(f"request {j}: an answer of neither weight set")
                        else:
                            counts[which] += 1
            finally:
                c.close()

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            for seed in (3, 11, 3, 11, 3):
                time.sleep(0.3)
                self.client.load_model("synthetic:tiny", seed=seed)
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join()
        print(f"answers during 5 swaps: {counts['old']} old, {counts['new']} new, "
              f"{len(failures)} failed", file=sys.stderr)
        self.assertEqual(failures, [])
        self.assertGreater(counts["old"], 0)
        self.assertGreater(counts["new"], 0)
        # The last load was seed 3: the old answers again.
        for x, y in zip(xs, old):
            np.testing.assert_array_equal(self.client.infer(x), y)

    def test_failed_loads_leave_the_served_weights(self):
        x = np.random.default_rng().uniform(-1, 1, size=(7, H)).astype(np.float32)
        before = self.client.infer(x)
        cases = [("synthetic:qwen1.5-moe-a2.7b", grpc.StatusCode.FAILED_PRECONDITION,
                  "hidden_size"),
                 ("/nonexistent/checkpoint", grpc.StatusCode.NOT_FOUND, "/nonexistent"),
                 ("synthetic:no-such-preset", grpc.StatusCode.NOT_FOUND, "no-such-preset")]
        for model, code, words in cases:
            with self.assertRaises(grpc.RpcError) as e:
                self.client.load_model(model)
            self.assertEqual(e.exception.code(), code, e.exception.details())
            self.assertIn(words, e.exception.details())
            np.testing.assert_array_equal(self.client.infer(x), before)
        self.assertTrue(self.client.model_ready())


class Token(unittest.TestCase):
    def test_every_rpc_but_health_needs_the_token(self):
        import os
        import tempfile
        fd, path = tempfile.mkstemp()
        os.write(fd, b"py-token\n")
        os.close(fd)
        with Cluster(2, [f"--auth-token-file={path}"]) as cluster:
            anonymous = Client(cluster.address)
            with self.assertRaises(grpc.RpcError) as e:
                anonymous.live()
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            with self.assertRaises(InferError) as e2:
                anonymous.infer(np.zeros((1, H), np.float32))
            self.assertEqual(e2.exception.code, grpc.StatusCode.UNAUTHENTICATED)
            with self.assertRaises(grpc.RpcError) as e3:
                reflection_services(anonymous.channel)
            self.assertEqual(e3.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(anonymous.health(), "SERVING")
            wrong = Client(cluster.address, token="nope")
            with self.assertRaises(grpc.RpcError) as e:
                wrong.model_metadata()
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            good = Client(cluster.address, token="py-token")
            self.assertTrue(good.live())
            self.assertEqual(good.infer(np.zeros((1, H), np.float32)).shape, (1, H))
            self.assertIn("inference.GRPCInferenceService",
                          reflection_services(good.channel, good.metadata))


if __name__ == "__main__":
    sys.exit(unittest.main(verbosity=2))
