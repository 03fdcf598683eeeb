"""Starts `mpirun -np N epserve` for a Python test (synthetic:tiny, port 0, a ready file;
client/python/epserve_local.py) and stops it with SIGTERM. EPSERVE_BINARY and EPSERVE_MPIEXEC
come from ctest's environment."""

import os
import urllib.request

from epserve_local import LocalServer


class Cluster(LocalServer):
    def __init__(self, ranks=2, args=(), ready_timeout=120):
        super().__init__(os.environ["EPSERVE_BINARY"], "synthetic:tiny", workers=ranks - 1,
                         args=args, ready_timeout=ready_timeout)

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
