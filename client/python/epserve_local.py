"""Starts a local epserve job for a program or a test on this host: `mpirun -np 1+W epserve`
bound to 127.0.0.1 with free ports and a ready file, its output in a log file, stopped with
SIGTERM (then SIGKILL of its process group after `timeout`) by stop() or at the end of a `with`
block.

    with LocalServer("build/server/epserve", "synthetic:tiny", workers=2) as s:
        client = epserve_client.Client(s.address)
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time


class ServerError(RuntimeError):
    """The job could not be started, or did not become ready; the message holds its log."""


class LocalServer:
    """`binary` is the epserve executable, `model` what --model takes (a checkpoint folder or
    synthetic:<preset>), `args` more epserve flags; `mpiexec` defaults to $EPSERVE_MPIEXEC, else
    mpirun on PATH. Open MPI may run as root and oversubscribe; PoCL gets one thread per rank
    unless POCL_MAX_PTHREAD_COUNT says otherwise. After the constructor returns, `address` and
    `metrics_address` are where the job listens."""

    def __init__(self, binary, model, *, workers=2, device="cpu", args=(), ready_timeout=300,
                 mpiexec=None):
        mpiexec = mpiexec or os.environ.get("EPSERVE_MPIEXEC") or shutil.which("mpirun")
        if not mpiexec:
            raise ServerError("no mpirun on PATH (apt-get install openmpi-bin)")
        if not os.access(binary, os.X_OK):
            raise ServerError(f"no epserve executable at {binary} (build it: deploy/build.sh)")
        self.dir = tempfile.mkdtemp(prefix="epserve-local-")
        ready = os.path.join(self.dir, "ready.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        env.setdefault("POCL_MAX_PTHREAD_COUNT", "1")
        cmd = [mpiexec, "-np", str(1 + workers), "--oversubscribe", "--bind-to", "none", binary,
               f"--model={model}", f"--device={device}", "--grpc-address=127.0.0.1:0",
               "--metrics-address=127.0.0.1:0", f"--ready-file={ready}", *args]
        self.log_path = os.path.join(self.dir, "log.txt")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
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
                self._fail("epserve exited before it was ready")
            time.sleep(0.05)
        self._fail(f"epserve not ready within {ready_timeout} s")

    def _fail(self, why):
        self.stop()
        raise ServerError(f"{why}:\n{self.read_log()}")

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=15):
        """Idempotent; the log stays readable until the object goes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()

    def __del__(self):
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
