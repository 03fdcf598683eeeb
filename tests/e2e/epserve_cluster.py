"""Starts `mpirun -np N epserve` for a Python test (synthetic:tiny, port 0, a ready file) and
stops it with SIGTERM. EPSERVE_BINARY and EPSERVE_MPIEXEC come from ctest's environment."""

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request


class Cluster:
    def __init__(self, ranks=2, args=(), ready_timeout=120):
        self.dir = tempfile.mkdtemp(prefix="epserve-pytest-")
        ready = os.path.join(self.dir, "ready.json")
        cmd = [os.environ["EPSERVE_MPIEXEC"], "-np", str(ranks), "--oversubscribe",
               "--bind-to", "none", os.environ["EPSERVE_BINARY"], "--model=synthetic:tiny",
               "--grpc-address=127.0.0.1:0", "--metrics-address=127.0.0.1:0",
               f"--ready-file={ready}", *args]
        self.log_path = os.path.join(self.dir, "log.txt")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            if os.path.exists(ready):
                with open(ready) as f:
                    addresses = json.load(f)
                self.address = addresses["grpc"]
                self.metrics_address = addresses["metrics"]
                return
            if self.proc.poll() is not None:
                raise RuntimeError("epserve exited before it was ready:\n" + self.read_log())
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("epserve not ready in time:\n" + self.read_log())

    def metric_sum(self, name):
        """The sum over its labels of metric `name` on the cluster's /metrics (0 if absent)."""
        total = 0.0
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.split("{")[0].split(" ")[0] == name:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def accepted(self):
        """Inference requests the front-end has accepted: answered plus in flight."""
        return (self.metric_sum("epserve_requests_total")
                + self.metric_sum("epserve_inflight_requests"))

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
