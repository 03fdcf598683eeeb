"""examples/generate.py: a small model of every family generates the same tokens with its MoE
layers served by epserve on CPU workers as run whole, and bad configurations are refused with
an error naming what differs before anything is generated.

Runs in the examples' virtual environment (EPSERVE_EXAMPLES_VENV, made by
examples/install-deps.sh, which tests/run.sh calls); without it the test says why and exits 77,
which ctest reports as skipped. EPSERVE_BUILD_DIR names the build folder, EPSERVE_BINARY the
executable.
"""

import importlib.util
import os
import re
import subprocess
import sys

SKIP = 77
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reexec_in_venv():
    """Returns when torch and transformers import here; else re-runs this file in the venv."""
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        return
    venv = os.environ.get("EPSERVE_EXAMPLES_VENV", "")
    python = os.path.join(venv, "bin", "python")
    if not venv or not os.access(python, os.X_OK) or os.environ.get("EPSERVE_IN_VENV"):
        print(f"SKIPPED: no examples venv at {venv!r}: run examples/install-deps.sh", flush=True)
        sys.exit(SKIP)
    os.environ["EPSERVE_IN_VENV"] = "1"
    os.execv(python, [python, *sys.argv])


reexec_in_venv()

import unittest  # noqa: E402

BUILD = os.environ.get("EPSERVE_BUILD_DIR", os.path.join(ROOT, "build"))
sys.path[:0] = [os.path.join(BUILD, "proto", "python"), os.path.join(ROOT, "client", "python"),
                os.path.join(ROOT, "examples")]

import torch  # noqa: E402
import transformers  # noqa: E402

import epserve_client  # noqa: E402
import epserve_hf as hf  # noqa: E402
from epserve_local import LocalServer  # noqa: E402

EPSERVE = os.environ.get("EPSERVE_BINARY", os.path.join(BUILD, "server", "epserve"))
SMALL = ["--layers", "2", "--hidden", "64", "--ffn", "32"]


def run_example(*args):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--build", BUILD,
           "--epserve", EPSERVE, "--speed", "none", "--server-arg=--no-ffn-tune", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(out.stdout[-6000:], out.stderr[-3000:], sep="\n", flush=True)
    return out


def small_model(folder, seed, hidden=64, layers=2, family="qwen2_moe"):
    config = hf.tiny_config(family, layers=layers, hidden=hidden, ffn=32)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.randomize(model, seed)
    if folder:
        model.save_pretrained(folder)
    return model.eval()


class GeneratesTheWholeModelsTokens(unittest.TestCase):
    def test_every_family_on_cpu_workers(self):
        out = run_example(*SMALL, "--families", "all", "--prompts", "2")
        self.assertEqual(out.returncode, 0)
        found = re.findall(r"^(\w+): 2 layers.*?\n.*?(\d+)/(\d+) sequences of 32 greedy tokens "
                           r"identical", out.stdout, re.M | re.S)
        self.assertEqual([f for f, _, _ in found], list(hf.FAMILIES))
        for family, same, total in found:
            self.assertEqual(int(total), 2 + 16, family)
        for failure in ("MISMATCH", "ROUTING", "LOGITS"):
            self.assertNotIn(failure, out.stdout)
        # Every sequence is identical but those excused by a tie (the whole model's own top two
        # tokens, or a row's experts in FP64, within rounding), each named on a line.
        ties = len(re.findall(r"^  near tie: prompt", out.stdout, re.M))
        self.assertEqual(sum(int(t) - int(s) for _, s, t in found), ties)
        self.assertLessEqual(ties, 2, "too many ties to be a meaningful check")


class RefusesBadConfigurations(unittest.TestCase):
    """Each error comes from the checks before generation and names what differs."""

    @classmethod
    def setUpClass(cls):
        import tempfile
        cls.tmp = tempfile.TemporaryDirectory(prefix="epserve-example-test-")
        cls.folder = os.path.join(cls.tmp.name, "a")
        cls.seed = int.from_bytes(os.urandom(4), "little")
        cls.model = small_model(cls.folder, cls.seed)
        cls.server = LocalServer(EPSERVE, cls.folder, args=["--no-ffn-tune"])
        cls.client = epserve_client.Client(cls.server.address)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.tmp.cleanup()

    def refused(self, model, client=None, *mentions):
        with self.assertRaises(hf.ConfigError) as e:
            hf.check_served(model, client or self.client, tolerance=1e-4)
        for m in mentions:
            self.assertIn(m, str(e.exception))
        return str(e.exception)

    def test_the_served_model_passes(self):
        errors = hf.check_served(self.model, self.client, tolerance=1e-4)
        self.assertEqual(sorted(errors), [0, 1])

    def test_another_hidden_size(self):
        self.refused(small_model(None, self.seed, hidden=96), None, "hidden size", "64", "96")

    def test_another_layer_count(self):
        self.refused(small_model(None, self.seed, layers=1), None, "layer count", "[1]")

    def test_another_checkpoint_of_the_same_shape(self):
        msg = self.refused(small_model(None, self.seed + 1), None, "layer 0")
        self.assertRegex(msg, "routing differs|output differs")

    def test_a_model_name_that_does_not_exist(self):
        client = epserve_client.Client(self.server.address, "no-such-model")
        self.refused(self.model, client, "no-such-model", "NOT_FOUND", "moe")

    def test_a_layer_the_server_does_not_serve(self):
        with LocalServer(EPSERVE, self.folder, args=["--no-ffn-tune", "--layers=0"]) as s:
            self.refused(self.model, epserve_client.Client(s.address), "[1]", "does not serve")

    def test_the_command_line_says_so_and_exits_2(self):
        other = os.path.join(self.tmp.name, "b")
        small_model(other, self.seed, hidden=96)
        out = run_example("--server", self.server.address, "--checkpoint", other)
        self.assertEqual(out.returncode, 2)
        self.assertIn("hidden size", out.stdout)
        out = run_example("--families", "llama")
        self.assertEqual(out.returncode, 2)
        self.assertIn("unknown family 'llama'", out.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
