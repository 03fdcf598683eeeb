"""deploy/'s configuration agrees with itself and with epserve: the local config, the
Kubernetes manifests and the container image parse, name only flags `epserve --help` lists,
carry the same flags, and point at each other (ports, labels, paths, replicas). Also the
launcher's own options: dry run, precedence, bad input.

Needs EPSERVE_BINARY (ctest sets it) and python3-yaml."""

import os
import re
import shlex
import subprocess
import sys
import unittest

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
sys.path.insert(0, DEPLOY)
import supervisor  # noqa: E402

LAUNCHER = os.path.join(DEPLOY, "epserve-local")
# Flags that differ between one host and a Kubernetes cluster; everything else must match.
PER_SITE_FLAGS = {"grpc-address", "metrics-address", "heap", "memory-limit"}
IMAGE_ROOT = "/opt/epserve"


def epserve_flags():
    out = subprocess.run([os.environ["EPSERVE_BINARY"], "--help"], capture_output=True,
                         text=True, check=True).stdout
    flags = set(re.findall(r"^  --([a-z0-9-]+)", out, re.M))
    assert len(flags) > 20, out
    return flags


def launcher(*args, check=True):
    return subprocess.run([LAUNCHER, *args], capture_output=True, text=True, check=check)


def dry_run_flags(*args):
    """epserve's flag names in the command line epserve-local would run."""
    cmd = shlex.split(launcher(*args, "--dry-run").stdout)
    binary = next(i for i, a in enumerate(cmd) if a.endswith("/epserve"))
    return cmd[:binary], [supervisor.flag_name(a) for a in cmd[binary + 1:]
                          if supervisor.flag_name(a)]


def load_manifests():
    docs = []
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml"):
            with open(os.path.join(K8S, name)) as f:
                for doc in yaml.safe_load_all(f):
                    if doc:
                        docs.append((name, doc))
    return docs


class Config(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.flags = epserve_flags()
        cls.local_launcher, cls.local = supervisor.load_config(
            os.path.join(DEPLOY, "epserve.toml"))
        cls.docs = load_manifests()
        cls.by_kind = {}
        for name, doc in cls.docs:
            cls.by_kind.setdefault(doc["kind"], []).append(doc)
        cm = cls.by_kind["ConfigMap"][0]
        cls.k8s_toml = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                    f"epserve-k8s-{os.getpid()}.toml")
        with open(cls.k8s_toml, "w") as f:
            f.write(cm["data"]["epserve.toml"])
        cls.k8s_launcher, cls.k8s = supervisor.load_config(cls.k8s_toml)

    @classmethod
    def tearDownClass(cls):
        os.unlink(cls.k8s_toml)

    # ---- flags
    def test_local_config_names_only_epserve_flags(self):
        self.assertLessEqual(set(self.local), self.flags)
        _, names = dry_run_flags("--config", os.path.join(DEPLOY, "epserve.toml"))
        self.assertEqual(set(names), set(self.local))
        self.assertLessEqual(set(names), self.flags)

    def test_k8s_config_names_only_epserve_flags(self):
        self.assertLessEqual(set(self.k8s), self.flags)
        _, names = dry_run_flags("--config", self.k8s_toml)
        self.assertLessEqual(set(names), self.flags)

    def test_k8s_carries_the_local_flags(self):
        self.assertEqual(set(self.k8s), set(self.local))
        for key, value in self.local.items():
            if key not in PER_SITE_FLAGS:
                self.assertEqual(self.k8s[key], value, f"--{key} differs")

    def test_k8s_serves_across_pods(self):
        self.assertIn(self.k8s["heap"], ("rma", "auto"))
        for key in ("grpc-address", "metrics-address"):
            self.assertTrue(self.k8s[key].startswith("0.0.0.0:"), f"--{key}={self.k8s[key]}")
        args = self.k8s_launcher["mpirun_args"]
        self.assertIn("tcp,self", args)
        self.assertNotIn("hostfile", self.k8s_launcher)  # the MPI Operator provides it
        self.assertNotEqual(self.k8s_launcher.get("stopped_exit_status", 0), 0)

    def test_the_launcher_options_are_not_epserve_flags(self):
        out = launcher("--help").stdout
        options = set(re.findall(r"--([a-z][a-z-]+)", out)) - {"help"}
        self.assertTrue(options)
        self.assertFalse(options & self.flags, options & self.flags)

    # ---- Kubernetes objects
    def mpijob(self):
        [job] = self.by_kind["MPIJob"]
        self.assertEqual(job["apiVersion"], "kubeflow.org/v2beta1")
        return job

    def launcher_container(self):
        spec = self.mpijob()["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
        return spec, spec["containers"][0]

    def test_every_manifest_is_in_the_kustomization(self):
        [kust] = [doc for name, doc in self.docs if doc["kind"] == "Kustomization"]
        files = {name for name, doc in self.docs if doc["kind"] != "Kustomization"}
        self.assertEqual(set(kust["resources"]), files)
        for name, doc in self.docs:
            self.assertIn("apiVersion", doc, name)
            self.assertIn("name", doc.get("metadata", {"name": "kustomization"}), name)

    def test_mpijob_runs_the_launcher_with_the_config(self):
        job = self.mpijob()
        spec = job["spec"]
        self.assertTrue(spec["runLauncherAsWorker"])  # rank 0 in the launcher pod
        self.assertEqual(spec["slotsPerWorker"], 1)
        self.assertEqual(spec["mpiReplicaSpecs"]["Worker"]["replicas"],
                         self.k8s_launcher["workers"])
        pod, c = self.launcher_container()
        self.assertEqual(c["command"][0], f"{IMAGE_ROOT}/deploy/epserve-local")
        config_path = c["command"][c["command"].index("--config") + 1]
        mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        cm = self.by_kind["ConfigMap"][0]
        self.assertEqual(volume["configMap"]["name"], cm["metadata"]["name"])
        self.assertEqual(os.path.basename(config_path), "epserve.toml")
        for env in c.get("env", []):  # forwarded to the ranks
            self.assertIn(env["name"], self.k8s_launcher["mpirun_args"])
        worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        self.assertEqual(worker["image"], c["image"])
        self.assertNotIn("command", worker)  # the operator's sshd

    def test_probes_ask_grpc_health_on_the_served_port(self):
        _, c = self.launcher_container()
        grpc_port = int(self.k8s["grpc-address"].rsplit(":", 1)[1])
        metrics_port = int(self.k8s["metrics-address"].rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(ports, {"grpc": grpc_port, "metrics": metrics_port})
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(c[probe]["grpc"]["port"], grpc_port, probe)

    def test_service_and_servicemonitor_reach_rank_0(self):
        job = self.mpijob()
        [svc] = self.by_kind["Service"]
        self.assertEqual(svc["spec"]["selector"], {
            "training.kubeflow.org/job-name": job["metadata"]["name"],
            "training.kubeflow.org/job-role": "launcher"})
        self.assertNotEqual(svc["metadata"]["name"], job["metadata"]["name"])  # the operator's
        _, c = self.launcher_container()
        names = {p["name"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            self.assertIn(port["targetPort"], names)
        [mon] = self.by_kind["ServiceMonitor"]
        self.assertEqual(mon["apiVersion"], "monitoring.coreos.com/v1")
        labels = svc["metadata"]["labels"]
        for k, v in mon["spec"]["selector"]["matchLabels"].items():
            self.assertEqual(labels.get(k), v)
        self.assertEqual(labels[mon["spec"]["jobLabel"]], "epserve")  # monitoring/'s job
        self.assertIn(mon["spec"]["endpoints"][0]["port"], {p["name"] for p in svc["spec"]["ports"]})

    # ---- the image
    def test_dockerfile_builds_with_the_projects_own_steps(self):
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            text = f.read()
        self.assertRegex(text, r"(?m)^FROM debian:(12|bookworm)\b")
        self.assertRegex(text, r"(?m)^WORKDIR " + re.escape(IMAGE_ROOT) + "$")
        self.assertIn("deploy/install-deps.sh", text)
        self.assertIn("deploy/build.sh", text)
        self.assertIn("openssh-server", text)
        cmd = re.search(r"(?ms)^CMD (\[.*?\])\s*$", text).group(1)
        cmd = yaml.safe_load(cmd.replace("\\\n", " "))
        self.assertEqual(cmd[0], f"{IMAGE_ROOT}/deploy/epserve-local")
        names = {supervisor.flag_name(a) for a in cmd[1:] if supervisor.flag_name(a)}
        self.assertLessEqual(names - {"config"}, self.flags)
        for port in re.search(r"(?m)^EXPOSE (.*)$", text).group(1).split():
            self.assertIn(f"0.0.0.0:{port}", " ".join(cmd))

    # ---- the launcher
    def test_dry_run_command_line(self):
        mpirun, names = dry_run_flags("-w", "3", "--model=synthetic:tiny", "--heap", "rma")
        self.assertEqual(mpirun[:3], ["mpirun", "-np", "4"])
        self.assertEqual(names, ["model", "heap"])

    def test_command_line_flags_win_over_the_config(self):
        out = launcher("--config", os.path.join(DEPLOY, "epserve.toml"), "-w", "1",
                       "--max-batch-tokens=32", "--dry-run").stdout
        self.assertIn("-np 2", out)
        self.assertLess(out.index("--max-batch-tokens=256"), out.index("--max-batch-tokens=32"))

    def test_bad_input_is_refused_with_a_reason(self):
        bad = self.k8s_toml + ".bad"
        for text, words in (('[launcher]\nworkerz = 2\n', "unknown [launcher] key 'workerz'"),
                            ('[launcher]\nworkers = "2"\n', "workers must be a int"),
                            ('[launcher]\nrestart = "sometimes"\n', "restart must be one of"),
                            ('[epserve\n', "--config"),
                            ('[other]\n', "unknown table")):
            with open(bad, "w") as f:
                f.write(text)
            r = launcher("--config", bad, "--dry-run", check=False)
            self.assertEqual(r.returncode, 2, text)
            self.assertIn(words, r.stderr, text)
        os.unlink(bad)


if __name__ == "__main__":
    unittest.main(verbosity=2)
