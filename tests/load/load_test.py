"""epserve-load and client/python/example.py against local clusters (synthetic:tiny).

EPSERVE_LOAD, EPSERVE_PY_EXAMPLE, EPSERVE_BINARY and EPSERVE_MPIEXEC come from ctest's
environment; epserve_cluster (tests/e2e) starts the clusters."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

from epserve_cluster import Cluster

LOAD = os.environ["EPSERVE_LOAD"]
PERCENTILES = ["p50", "p90", "p95", "p99", "p999", "max"]


def run_load(*args, check=True):
    r = subprocess.run([LOAD, "--progress=off", "--warmup=0.2s", *args], capture_output=True,
                       text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"epserve-load {' '.join(args)} exited {r.returncode}:\n"
                             f"{r.stdout}\n{r.stderr}")
    return r


def steps_of(r):
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


class StepChecks:
    def check_step(self, step, ok=None, requests=None):
        """Counts add up and percentiles are ordered."""
        self.assertEqual(step["requests"], step["ok"] + sum(step["errors"].values()), step)
        if ok is not None:
            self.assertEqual(step["ok"], ok, step)
        if requests is not None:
            self.assertEqual(step["requests"], requests, step)
        if step["ok"] > 0:
            lat = [step["latency_ms"][p] for p in PERCENTILES]
            self.assertEqual(lat, sorted(lat), step)
            self.assertGreater(lat[0], 0)
            self.assertGreater(step["tokens_per_s"], 0)
            self.assertAlmostEqual(step["requests_per_s"] * step["duration_s"], step["ok"],
                                   delta=0.01 * step["ok"] + 0.01)
        else:
            self.assertIsNone(step["latency_ms"]["p50"])
        self.assertEqual(set(step["errors"]), set(step["error_examples"]))


class LoadAgainstCluster(unittest.TestCase, StepChecks):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(3, ["--max-batch-tokens=16", "--max-queue-delay-us=200"])
        cls.target = f"--target={cls.cluster.address}"

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def test_closed_loop_sweep_verified(self):
        r = run_load(self.target, "--concurrency=1,4", "--requests=60", "--tokens=1-8",
                     "--json", "--verify-model=synthetic:tiny", "--verify-seed=0")
        steps = steps_of(r)
        self.assertEqual([s["concurrency"] for s in steps], [1, 4])
        for s in steps:
            self.assertEqual(s["mode"], "closed")
            self.check_step(s, ok=60, requests=60)
            self.assertEqual(s["verified"], 60)
            self.assertTrue(60 <= s["tokens"] <= 480, s)
            server = s["server"]
            self.assertIsNotNone(server, s)
            # The window's first statistics read answers before a measured request is sent,
            # so the split covers all 60 (and any warmup request still in flight then).
            self.assertGreaterEqual(server["requests"], 60, server)
            self.assertGreater(server["compute_infer_ms"], 0)
            self.assertGreaterEqual(server["queue_ms"], 0)
            self.assertGreater(server["batches"], 0)
            self.assertTrue(1 <= server["mean_batch_rows"] <= 16, server)

    def test_open_loop_poisson_counts_every_arrival(self):
        r = run_load(self.target, "--rate=100", "--arrival=poisson", "--duration=1s",
                     "--tokens=4", "--json")
        (s,) = steps_of(r)
        self.assertEqual(s["mode"], "open")
        self.assertEqual(s["arrival"], "poisson")
        self.assertEqual(s["rate"], 100)
        self.check_step(s, ok=s["requests"])
        self.assertTrue(55 <= s["requests"] <= 150, s)  # Poisson(100) over 1 s
        self.assertGreaterEqual(s["duration_s"], 1.0)

    def test_open_loop_request_count_and_stream(self):
        r = run_load(self.target, "--rate=200", "--requests=50", "--stream", "--dtype=FP16",
                     "--tokens=1-4", "--json", "--verify-model=synthetic:tiny")
        (s,) = steps_of(r)
        self.check_step(s, ok=50, requests=50)
        self.assertEqual(s["verified"], 50)

    def test_stream_closed_loop_bf16_verified(self):
        r = run_load(self.target, "--stream", "--streams=2", "--concurrency=8", "--requests=80",
                     "--dtype=bf16", "--tokens=1-6", "--json", "--verify-model=synthetic:tiny")
        (s,) = steps_of(r)
        self.check_step(s, ok=80, requests=80)
        self.assertEqual(s["verified"], 80)

    def test_verify_reports_mismatches_as_errors(self):
        r = run_load(self.target, "--requests=10", "--tokens=2", "--json",
                     "--verify-model=synthetic:tiny", "--verify-seed=1")
        (s,) = steps_of(r)
        self.check_step(s, ok=0, requests=10)
        self.assertEqual(s["errors"], {"verify_mismatch": 10})
        self.assertIn("reference", s["error_examples"]["verify_mismatch"])
        r = run_load(self.target, "--requests=3", "--tokens=2", "--verify-model=synthetic:tiny",
                     "--verify-seed=1", "--fail-on-error", check=False)
        self.assertEqual(r.returncode, 1, r.stderr)

    def test_csv_table_and_plot(self):
        with tempfile.TemporaryDirectory() as tmp:
            svg = os.path.join(tmp, "sweep.svg")
            r = run_load(self.target, "--concurrency=1,2,4", "--requests=20", "--csv",
                         f"--plot={svg}")
            lines = r.stdout.strip().splitlines()
            self.assertEqual(len(lines), 4)
            header = lines[0].split(",")
            self.assertEqual(header[:3], ["mode", "concurrency", "rate"])
            for line in lines[1:]:
                row = dict(zip(header, line.split(",")))
                self.assertEqual(len(line.split(",")), len(header))
                self.assertEqual(row["ok"], "20")
                self.assertLessEqual(float(row["p50_ms"]), float(row["p99_ms"]))
            with open(svg) as f:
                text = f.read()
            self.assertTrue(text.startswith("<svg"))
            self.assertEqual(text.count("<polyline"), 4)  # p50, p90, p99, p99.9
            self.assertEqual(text.count("<circle"), 12)   # 3 steps x 4 lines
        r = run_load(self.target, "--requests=5", "--tokens=2")
        self.assertIn("closed loop, concurrency 1", r.stdout)
        self.assertIn("server (ms)", r.stdout)

    def test_flags(self):
        r = subprocess.run([LOAD, "--help"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0)
        for flag in ("--tls-ca", "--token-file", "--stream", "--dtype", "--verify-model",
                     "--csv", "--plot", "--max-outstanding"):
            self.assertIn(flag, r.stdout)
        self.assertEqual(run_load("--bogus", check=False).returncode, 1)
        self.assertEqual(run_load("--rate=5", "--concurrency=2", check=False).returncode, 1)
        self.assertEqual(run_load("--dtype=int8", check=False).returncode, 1)
        # absl-era spellings with underscores still work.
        r = run_load(self.target, "--connect_timeout=5s", "--max_outstanding=10",
                     "--requests=3", "--json", "--fail_on_error")
        self.check_step(steps_of(r)[0], ok=3)
        # Nobody listening: exit status 2.
        r = run_load("--target=127.0.0.1:1", "--connect-timeout=1s", check=False)
        self.assertEqual(r.returncode, 2)

    def test_python_example(self):
        r = subprocess.run(["/usr/bin/python3", os.environ["EPSERVE_PY_EXAMPLE"],
                            f"--target={self.cluster.address}", "--tokens=3"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("output (3, 64) float32", r.stdout)
        r = subprocess.run(["/usr/bin/python3", os.environ["EPSERVE_PY_EXAMPLE"],
                            f"--target={self.cluster.address}", "--tokens=5", "--shared-memory"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.count("identical to the inline answer"), 2, r.stdout)

    def test_moe_layer_function(self):
        import numpy as np
        import epserve_client
        x = np.random.default_rng(0).uniform(-1, 1, size=(5, 64)).astype(np.float32)
        y = epserve_client.moe_layer(x, self.cluster.address)
        self.assertEqual((y.shape, y.dtype), ((5, 64), np.float32))
        y1 = epserve_client.moe_layer(x[0], self.cluster.address)
        np.testing.assert_allclose(y1, y[0], rtol=1e-5, atol=1e-6)
        y16 = epserve_client.moe_layer(x.astype(np.float16), self.cluster.address)
        self.assertEqual(y16.dtype, np.float16)
        self.assertLess(np.abs(y16 - y).max() / np.abs(y).max(), 5e-3)


class Refusals(unittest.TestCase, StepChecks):
    """A cluster that needs a bearer token over TLS and holds at most 16 queued rows."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.cert, key, cls.token_file = (os.path.join(d, n) for n in
                                         ("cert.pem", "key.pem", "token"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", key, "-out", cls.cert, "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        with open(cls.token_file, "w") as f:
            f.write("load-token\n")
        cls.cluster = Cluster(2, [f"--tls-cert={cls.cert}", f"--tls-key={key}",
                                  f"--auth-token-file={cls.token_file}",
                                  "--max-queue-tokens=16", "--max-request-tokens=16",
                                  "--max-batch-tokens=8",
                                  "--max-queue-delay-us=2000"])
        cls.args = [f"--target={cls.cluster.address}", f"--tls-ca={cls.cert}"]

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        cls.tmp.cleanup()

    def test_missing_token_is_counted_as_unauthenticated(self):
        r = run_load(*self.args, "--hidden=64", "--concurrency=2", "--requests=20", "--json")
        (s,) = steps_of(r)
        self.check_step(s, ok=0, requests=20)
        self.assertEqual(s["errors"], {"UNAUTHENTICATED": 20})
        self.assertIsNone(s["server"])  # ModelStatistics needs the token too

    def test_queue_bound_refusals_are_counted(self):
        # A refusal comes back at once and its client sends again, so count by time: within
        # a second some requests get through and many are refused.
        for mode in ([], ["--stream"]):
            r = run_load(*self.args, f"--token-file={self.token_file}", "--concurrency=16",
                         "--tokens=16", "--duration=1s", "--json", *mode)
            (s,) = steps_of(r)
            self.check_step(s)
            self.assertGreater(s["ok"], 0, s)
            self.assertGreater(s["errors"].get("RESOURCE_EXHAUSTED", 0), 0, s)
            self.assertEqual(set(s["errors"]), {"RESOURCE_EXHAUSTED"}, s)
            self.assertGreater(s["server"]["failed"], 0)

    def test_token_flag_and_example_over_tls(self):
        r = run_load(*self.args, "--token=load-token", "--requests=10", "--tokens=4", "--json")
        self.check_step(steps_of(r)[0], ok=10)
        r = subprocess.run(["/usr/bin/python3", os.environ["EPSERVE_PY_EXAMPLE"],
                            f"--target={self.cluster.address}", f"--tls-ca={self.cert}",
                            f"--token-file={self.token_file}"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    sys.exit(unittest.main(verbosity=2))
