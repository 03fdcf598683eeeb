"""epserve's launcher and supervisor: runs `mpirun -np 1+W epserve ...`, restarts the job
with exponential backoff when a rank dies or the workers stop answering, replaces a job that
serves on after a worker's death with a new one on the same addresses, and stops it
cleanly on SIGTERM/SIGINT. Run through deploy/epserve-local (which sets deploy/env.sh's
environment); `deploy/epserve-local --help` lists the options.

Configuration comes from a TOML file (--config), then the command line (which wins):

    [launcher]                    # options of this program (LAUNCHER_KEYS below)
    workers = 2
    [epserve]                     # flags of epserve: key = value -> --key=value
    model = "synthetic:tiny"

Python 3.11 standard library only (tomllib), so it runs on a bare Debian 12 and in the
container image. Exit status: 0 (or [launcher] stopped_exit_status) after a clean stop on a
signal (every rank left; see Job.clean_stop), 1 when the job could not be kept running or did
not stop cleanly, 2 for bad usage.
"""

import argparse
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# [launcher] keys, their types and defaults. A unit is in every name that has one.
LAUNCHER_KEYS = {
    "workers": (int, 2),                      # expert worker ranks W (mpirun -np 1+W)
    "restart": (str, "on-failure"),           # on-failure | never
    "max_restarts": (int, 0),                 # restarts before giving up; 0: no limit
    "backoff_initial_seconds": (float, 1.0),  # first restart delay, doubled per failure
    "backoff_max_seconds": (float, 30.0),     # longest restart delay
    "stable_seconds": (float, 60.0),          # a job serving this long resets the backoff
    "unhealthy_seconds": (float, 10.0),       # not SERVING this long: restart the job
    "health_interval_seconds": (float, 1.0),  # how often rank 0's gRPC health is asked
    "health_host": (str, ""),                 # where rank 0 is reached; "": its address
    "health_probe": (str, ""),                # epserve-health; "": beside the epserve binary
    "health_tls_ca": (str, ""),               # PEM roots for the probe when gRPC uses TLS
    "stop_timeout_seconds": (float, 20.0),    # after SIGTERM, when mpirun gets SIGKILL
    "stopped_exit_status": (int, 0),          # exit status after a clean stop on a signal
    "startup_timeout_seconds": (float, 900.0),  # a job not serving by then is restarted
    "hostfile": (str, ""),                    # mpirun --hostfile; "": this host only
    "mpirun": (str, "mpirun"),                # the MPI launcher program
    "mpirun_args": (list, ["--bind-to", "none"]),  # extra mpirun arguments
    "binary": (str, ""),                      # epserve; "": $EPSERVE_BINARY or <build>/server/epserve
    # Every rank on this host (no hostfile) and the shm heap: mpirun --enable-recovery, so that
    # the survivors of a worker's death serve on where every expert has a second copy
    # (epserve --redundant-experts, --eplb-min-copies=2, --shared-expert=owner).
    "serve_through_worker_death": (bool, True),
    # A job that serves on after a worker's death (epserve_workers_lost > 0 on /metrics):
    # start a new job beside it on the same addresses (both bind them with SO_REUSEPORT),
    # and once it serves, SIGTERM the old one, which answers what it accepted and leaves.
    "replace_degraded": (bool, True),
}
RESTART_MODES = ("on-failure", "never")


def log(message):
    sys.stderr.write(f"epserve-local: {message}\n")
    sys.stderr.flush()


class UsageError(Exception):
    pass


def load_config(path):
    """The ([launcher] dict, [epserve] dict) of a TOML file; UsageError when malformed."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--config {path}: {e}") from None
    unknown = set(data) - {"launcher", "epserve"}
    if unknown:
        raise UsageError(f"--config {path}: unknown table(s) {sorted(unknown)}; "
                         "expected [launcher] and [epserve]")
    launcher = data.get("launcher", {})
    for key, value in launcher.items():
        if key not in LAUNCHER_KEYS:
            raise UsageError(f"--config {path}: unknown [launcher] key '{key}'; "
                             f"known: {', '.join(LAUNCHER_KEYS)}")
        kind = LAUNCHER_KEYS[key][0]
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if kind is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if not ok or isinstance(value, bool) != (kind is bool):
            raise UsageError(f"--config {path}: [launcher] {key} must be a {kind.__name__}, "
                             f"got {value!r}")
    epserve = data.get("epserve", {})
    for key, value in epserve.items():
        if not isinstance(value, (str, int, float, bool)):
            raise UsageError(f"--config {path}: [epserve] {key} must be a string, number or "
                             f"boolean, got {value!r}")
    return launcher, epserve


def flag_args(epserve):
    """[epserve] table -> ["--key=value", ...] in the table's order."""
    args = []
    for key, value in epserve.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        args.append(f"--{key}={value}")
    return args


def flag_name(arg):
    """'--max-batch-tokens=32' -> 'max-batch-tokens'; None for a value or positional."""
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg[2:].split("=", 1)[0]
    return name[3:] if name.startswith("no-") else name


def flag_value(args, name):
    """The last value given to --name in args (--name=v or --name v), or None."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
        elif a == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return value


class Settings:
    """Everything one run needs: launcher settings and the epserve arguments."""

    def __init__(self, launcher, epserve_args):
        self.launcher = {k: launcher.get(k, default) for k, (_, default) in LAUNCHER_KEYS.items()}
        self.epserve_args = epserve_args
        if self.launcher["restart"] not in RESTART_MODES:
            raise UsageError(f"restart must be one of {', '.join(RESTART_MODES)}, "
                             f"got '{self.launcher['restart']}'")
        if self.launcher["workers"] < 1:
            raise UsageError(f"workers must be >= 1, got {self.launcher['workers']}")

    def __getattr__(self, key):
        try:
            return self.__dict__["launcher"][key]
        except KeyError:
            raise AttributeError(key) from None

    def binary(self):
        if self.launcher["binary"]:
            return self.launcher["binary"]
        if os.environ.get("EPSERVE_BINARY"):
            return os.environ["EPSERVE_BINARY"]
        build = os.environ.get("BUILD_DIR", os.path.join(ROOT, "build"))
        return os.path.join(build, "server", "epserve")

    def recovers(self):
        """Whether jobs run under mpirun --enable-recovery (serve_through_worker_death)."""
        return (self.serve_through_worker_death and not self.hostfile
                and flag_value(self.epserve_args, "heap") != "rma"
                and "--enable-recovery" not in self.mpirun_args)

    def command(self, ready_file):
        """The mpirun command line of one job."""
        cmd = [self.mpirun, "-np", str(self.workers + 1)]
        if self.hostfile:
            cmd += ["--hostfile", self.hostfile]
        if self.recovers():
            cmd.append("--enable-recovery")
        cmd += self.mpirun_args + [self.binary()] + self.epserve_args
        if ready_file and flag_value(self.epserve_args, "ready-file") is None:
            cmd.append(f"--ready-file={ready_file}")
        return cmd


def parse_args(argv):
    """(Settings, dry_run) from the command line; unknown --flags are epserve's."""
    p = argparse.ArgumentParser(
        prog="epserve-local", allow_abbrev=False,
        description="Starts an epserve cluster (rank 0 front-end + W expert workers) under "
        "mpirun, restarts it with backoff when a rank dies or the workers stop answering, and "
        "stops it cleanly on SIGTERM or SIGINT. Every argument it does not know is an epserve "
        "flag (epserve --help); those on the command line win over the config file's.",
        epilog="Exit status: 0 after a clean stop, 1 when the job could not be kept running or "
        "did not stop cleanly, 2 for bad usage.")
    p.add_argument("-w", "--workers", type=int, help="expert worker ranks W (default 2)")
    p.add_argument("--config", help="TOML file with [launcher] and [epserve] tables")
    p.add_argument("--restart", choices=RESTART_MODES,
                   help="restart the job after it fails (default on-failure)")
    p.add_argument("--max-restarts", type=int, help="give up after N restarts (0: never)")
    p.add_argument("--hostfile", help="mpirun hostfile (default: this host)")
    p.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                   help="an extra mpirun argument (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the mpirun command line and exit")
    known, rest = p.parse_known_args(argv)
    for a in rest:
        if a.startswith("-") and not a.startswith("--"):
            raise UsageError(f"unknown option {a}")
    launcher, epserve = {}, {}
    if known.config:
        launcher, epserve = load_config(known.config)
    for key in ("workers", "restart", "max_restarts", "hostfile"):
        if getattr(known, key) is not None:
            launcher[key] = getattr(known, key)
    if known.mpirun_arg:
        launcher["mpirun_args"] = list(launcher.get("mpirun_args",
                                                    LAUNCHER_KEYS["mpirun_args"][1]))
        launcher["mpirun_args"] += known.mpirun_arg
    return Settings(launcher, flag_args(epserve) + rest), known.dry_run


def read_ready_file(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def grpc_serving(probe, target, timeout_seconds, tls_ca=""):
    """rank 0's grpc.health.v1 status through the epserve-health probe: True SERVING, False
    answered but not serving, None no answer."""
    cmd = [probe, f"--target={target}", f"--timeout={timeout_seconds:g}s"]
    if tls_ca:
        cmd.append(f"--tls-ca={tls_ca}")
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout_seconds + 5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(r.returncode)


def metric(url, name, timeout_seconds):
    """Gauge `name` (no labels) from rank 0's /metrics; None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def workers_ready(url, timeout_seconds):
    """epserve_workers_ready from rank 0's /metrics; None when it does not answer."""
    return metric(url, "epserve_workers_ready", timeout_seconds)


class Job:
    """One mpirun job: its process, its output (echoed to stdout line by line) and what the
    output says about its ranks. Threads: a reader thread scans the output; the rest runs on
    the supervisor's thread."""

    DIED = re.compile(r"mpirun noticed that process rank (\d+) with PID \d+ on node (\S+) "
                      r"exited on signal (\d+)")
    NONZERO = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
    EXIT_CODE = re.compile(r"^\s*Exit code:\s*(\d+)")
    LEFT = re.compile(r"^\[epserve rank (\d+)\] (?:left the heap|a rank of this job died)")
    # rank 0 under --enable-recovery: a worker's process ended.
    WORKER_DIED = re.compile(r"^\[epserve rank 0\] worker (\d+) \(rank (\d+), pid \d+\) died")
    STOPPED = re.compile(r"^\[epserve rank 0\] stopped serving in")

    def __init__(self, settings, number, ready_file):
        self.settings = settings
        self.number = number
        self.ready_file = ready_file
        self.left = set()
        self.stopped_serving = False
        self.death = None        # "rank 1 (node vm) was killed by signal 9"
        self.nonzero_rank = None
        self.nonzero_code = None
        self.served_since = None  # monotonic time the ready file appeared
        self.dead_rank = None     # a worker's rank that died (rank 0 said so)
        self.degraded = False     # ... and the job serves on with the survivors
        self.replace_after = 0.0  # monotonic time a failed replacement may be tried again
        self.lock = threading.Lock()
        cmd = settings.command(ready_file)
        log(f"job {number}: {shlex.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            with self.lock:
                if m := self.LEFT.match(line):
                    self.left.add(int(m.group(1)))
                elif self.STOPPED.match(line):
                    self.stopped_serving = True
                elif m := self.DIED.search(line):
                    self.death = (f"rank {m.group(1)} (node {m.group(2)}) was killed by "
                                  f"signal {m.group(3)}")
                elif m := self.WORKER_DIED.match(line):
                    self.death = f"rank {m.group(2)} (worker {m.group(1)}) died"
                    self.dead_rank = int(m.group(2))
                    self.degraded = line.rstrip().endswith("serving on with them")
                elif m := self.NONZERO.search(line):
                    self.nonzero_rank = int(m.group(1))
                elif (m := self.EXIT_CODE.match(line)) and self.nonzero_rank is not None:
                    self.nonzero_code = int(m.group(1))

    def running(self):
        return self.proc.poll() is None

    def signal(self, sig):
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self):
        """SIGKILL to mpirun's session: mpirun and the local ranks."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout_seconds):
        try:
            self.proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(5)
        return self.proc.returncode

    def why_it_ended(self):
        code = self.proc.returncode
        with self.lock:
            if self.death:
                return self.death
            if self.nonzero_rank is not None:
                return (f"rank {self.nonzero_rank} exited with status "
                        f"{self.nonzero_code if self.nonzero_code is not None else '?'}")
        if code is not None and code < 0:
            return f"mpirun was killed by signal {-code}"
        return f"mpirun exited with status {code}"

    def clean_stop(self):
        """Whether every rank left cleanly: rank 0 finished serving and every rank left the
        heap (or, after a worker's death, every survivor left). mpirun's own exit status says
        nothing here: it is 1 after it forwarded SIGTERM even when every rank left cleanly."""
        with self.lock:
            missing = sorted(set(range(self.settings.workers + 1)) - self.left)
            if self.death and self.dead_rank is None:
                return False, self.death
            missing = [r for r in missing if r != self.dead_rank]
            if not self.stopped_serving:
                return False, "rank 0 did not report that it stopped serving"
            if missing:
                return False, f"rank(s) {', '.join(map(str, missing))} did not leave the heap"
        return True, ""


def _die_with_parent():
    """In the child before exec: SIGTERM when the supervisor dies (mpirun forwards it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Supervisor:
    def __init__(self, settings):
        self.settings = settings
        self.stop_signal = None
        self.wake = threading.Event()
        given = flag_value(settings.epserve_args, "ready-file")
        self.own_dir = None if given else tempfile.mkdtemp(prefix="epserve-local.")
        self.ready_file = given or os.path.join(self.own_dir, "ready.json")

    def on_signal(self, sig, _frame):
        if self.stop_signal is None:
            self.stop_signal = sig
            log(f"got {signal.Signals(sig).name}: stopping")
        self.wake.set()

    def sleep(self, seconds):
        """Sleeps unless a stop signal comes; True when one did."""
        self.wake.wait(seconds)
        return self.stop_signal is not None

    def health_probe(self):
        """The epserve-health binary, or None (then liveness falls back to /metrics)."""
        if self.settings.health_probe:
            return self.settings.health_probe
        server_dir = os.path.dirname(self.settings.binary())
        for candidate in (os.path.join(os.path.dirname(server_dir), "client", "epserve-health"),
                          os.path.join(server_dir, "epserve-health")):
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def grpc_target(self, ready):
        host, _, port = ready["grpc"].rpartition(":")
        host = host.strip("[]")
        if self.settings.health_host:
            host = self.settings.health_host
        elif host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def metrics_url(self, ready):
        host, _, port = ready["metrics"].rpartition(":")
        host = host.strip("[]")
        if self.settings.health_host:
            host = self.settings.health_host
        elif host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/metrics"

    def run(self):
        s = self.settings
        failures = 0   # consecutive, for the backoff
        restarts = 0
        number = 0
        job = None
        while True:
            if job is None:
                number += 1
                try:
                    os.unlink(self.ready_file)
                except FileNotFoundError:
                    pass
                job = Job(s, number, self.ready_file)
            outcome = self.watch(job)
            if outcome == "stopped":
                return self.stop(job)
            if outcome == "degraded":
                replacement = self.replace(job, number + 1)
                if replacement is None:
                    job.replace_after = time.monotonic() + s.backoff_max_seconds
                else:
                    number += 1
                    job = replacement
                continue
            # The job ended or was ended without a stop request.
            lived = time.monotonic() - job.started
            if outcome == "exited":
                reason = job.why_it_ended()
            else:
                reason = outcome
                self.end(job)
            if job.served_since is not None and time.monotonic() - job.served_since >= s.stable_seconds:
                failures = 0
            failures += 1
            if s.restart == "never":
                log(f"job {number} failed after {lived:.1f} s: {reason}; not restarting "
                    "(restart = never)")
                return 1
            if job.served_since is None and number == 1:
                log(f"job {number} failed before it served: {reason}; not restarting a job "
                    "that never started (fix the configuration)")
                return 1
            if s.max_restarts and restarts >= s.max_restarts:
                log(f"job {number} failed after {lived:.1f} s: {reason}; giving up after "
                    f"{restarts} restart(s)")
                return 1
            delay = min(s.backoff_initial_seconds * 2 ** (failures - 1), s.backoff_max_seconds)
            restarts += 1
            log(f"job {number} failed after {lived:.1f} s: {reason}; restarting in "
                f"{delay:.1f} s (restart {restarts}"
                f"{f' of {s.max_restarts}' if s.max_restarts else ''})")
            if self.sleep(delay):
                log("stopped before the restart")
                return s.stopped_exit_status
            job = None

    def replace(self, old, number):
        """Job `number` beside `old`, which serves on without a dead worker: same flags and
        addresses (both bind them with SO_REUSEPORT, so clients reach either); once it
        serves, `old` gets SIGTERM and answers what it accepted before it leaves (its clients'
        connections then go to the new job). The new job, or None when it did not come up
        (then `old` serves on, and the next try is backoff_max_seconds later)."""
        s = self.settings
        log(f"job {old.number} lost a worker and serves on without it: starting job {number} "
            "to take its place")
        try:
            os.unlink(self.ready_file)
        except FileNotFoundError:
            pass
        new = Job(s, number, self.ready_file)
        while True:
            if self.stop_signal is not None:
                self.end(new)
                return None
            if not new.running():
                new.wait(5)
                log(f"job {number} ended before it served ({new.why_it_ended()}); job "
                    f"{old.number} serves on without its lost worker")
                return None
            ready = read_ready_file(self.ready_file)
            if ready is not None and "metrics" in ready:
                break
            if time.monotonic() - new.started > s.startup_timeout_seconds:
                log(f"job {number} not serving after {s.startup_timeout_seconds:.0f} s; job "
                    f"{old.number} serves on without its lost worker")
                self.end(new)
                return None
            self.sleep(0.1)
        log(f"job {number} is serving on {ready.get('grpc')} (after "
            f"{time.monotonic() - new.started:.1f} s): stopping job {old.number}, which answers "
            "what it accepted")
        old.signal(signal.SIGTERM)
        if old.wait(s.stop_timeout_seconds) is None:
            old.kill_all()
            old.wait(10)
        log(f"job {old.number} left; job {number} serves in its place")
        return new

    def watch(self, job):
        """Until the job ends ("exited"), a stop signal comes ("stopped"), or the job must be
        restarted (a reason). Liveness is rank 0's gRPC health (SERVING while every worker is
        loaded and answering), asked through epserve-health: a slow or crowded /metrics
        endpoint never restarts a serving job. Without the probe (or with TLS and no
        health_tls_ca) it falls back to epserve_workers_ready on /metrics, where only a
        scrape reporting no ready worker counts, never one that goes unanswered."""
        s = self.settings
        check = None
        bad_since = None
        answered = False
        while True:
            if self.stop_signal is not None:
                return "stopped"
            if not job.running():
                job.wait(5)
                return "exited"
            now = time.monotonic()
            if job.served_since is None:
                ready = read_ready_file(self.ready_file)
                if ready is not None and "metrics" in ready:
                    job.served_since = now
                    check = self.health_check(ready)
                    log(f"job {job.number} is serving on {ready.get('grpc')} "
                        f"(after {now - job.started:.1f} s)")
                elif now - job.started > s.startup_timeout_seconds:
                    return f"not serving after {s.startup_timeout_seconds:.0f} s"
            elif (s.replace_degraded and job.degraded and job.running()
                  and now >= job.replace_after):
                return "degraded"
            elif s.unhealthy_seconds > 0:
                healthy, what = check()
                if healthy is not None:
                    answered = True
                if healthy or not answered:
                    bad_since = None
                elif bad_since is None:
                    bad_since = now
                    log(f"job {job.number}: not serving ({what})")
                elif now - bad_since >= s.unhealthy_seconds:
                    return f"not serving for {s.unhealthy_seconds:.0f} s ({what})"
            self.sleep(s.health_interval_seconds)

    def health_check(self, ready):
        """A function returning (True | False | None, what it saw) for the job behind `ready`."""
        s = self.settings
        timeout = max(1.0, s.health_interval_seconds)
        probe = self.health_probe()
        tls = flag_value(s.epserve_args, "tls-cert") is not None
        if probe is not None and "grpc" in ready and (not tls or s.health_tls_ca):
            target = self.grpc_target(ready)

            def by_grpc():
                serving = grpc_serving(probe, target, timeout, s.health_tls_ca)
                what = {True: "SERVING", False: "gRPC health NOT_SERVING",
                        None: f"no gRPC health answer from {target}"}[serving]
                return serving, what
            return by_grpc
        url = self.metrics_url(ready)
        log("liveness from /metrics (epserve_workers_ready): "
            + ("no epserve-health probe found" if probe is None
               else "gRPC uses TLS and health_tls_ca is not set"))

        def by_metrics():
            # Only a scrape that says no worker is ready counts against the job: a slow or
            # crowded /metrics endpoint (idle connections, a scanner) says nothing of the
            # service, and a dead rank 0 ends mpirun, which the loop sees as "exited".
            workers = workers_ready(url, timeout)
            if workers is None:
                return True, f"no answer from {url} (not counted against the job)"
            return workers > 0, f"epserve_workers_ready {workers:g}"
        return by_metrics

    def end(self, job):
        """Ends a job that is to be restarted: SIGTERM, then SIGKILL."""
        job.signal(signal.SIGTERM)
        if job.wait(min(self.settings.stop_timeout_seconds, 10)) is None:
            job.kill_all()
            job.wait(10)

    def stop(self, job):
        """SIGTERM to mpirun (which forwards it to every rank), wait, report the truth."""
        s = self.settings
        start = time.monotonic()
        job.signal(signal.SIGTERM)
        code = job.wait(s.stop_timeout_seconds)
        if code is None:
            log(f"job {job.number} still running {s.stop_timeout_seconds:.0f} s after "
                "SIGTERM: killing it")
            job.kill_all()
            job.wait(10)
            return 1
        clean, why = job.clean_stop()
        took = time.monotonic() - start
        if clean:
            log(f"stopped cleanly in {took:.1f} s (every rank left; mpirun's exit status "
                f"{code} is Open MPI's after a forwarded signal)")
            return s.stopped_exit_status
        log(f"job {job.number} did not stop cleanly in {took:.1f} s: {why} (mpirun exit status "
            f"{code})")
        return 1


def main(argv):
    try:
        settings, dry_run = parse_args(argv)
    except UsageError as e:
        log(str(e))
        return 2
    if dry_run:
        print(shlex.join(settings.command(None)))
        return 0
    if not os.access(settings.binary(), os.X_OK):
        log(f"no epserve binary at {settings.binary()}: run deploy/build.sh, or set "
            "EPSERVE_BINARY or [launcher] binary")
        return 2
    sup = Supervisor(settings)
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    try:
        return sup.run()
    finally:
        if sup.own_dir:
            try:
                os.unlink(sup.ready_file)
            except FileNotFoundError:
                pass
            os.rmdir(sup.own_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
