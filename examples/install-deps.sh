#!/usr/bin/env bash
# Installs what examples/ needs beyond deploy/install-deps.sh: transformers and the PyTorch it
# runs on (examples/requirements.txt, from PyPI; PyTorch's wheel brings its CUDA libraries,
# about 4 GiB installed, and runs on the CPU without a GPU) into a virtual environment made
# with Debian's python3 that also sees Debian's grpcio, protobuf and numpy:
# EPSERVE_EXAMPLES_VENV, default ~/.cache/epserve/examples-venv. tests/run.sh calls it, so
# that the suite's test of the example runs. Idempotent: once the pinned versions import, it
# asks no package index. Prints the venv's python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EPSERVE_EXAMPLES_VENV:-$HOME/.cache/epserve/examples-venv}"
req="$root/examples/requirements.txt"

"$root/deploy/install-deps.sh"
# The pinned versions, "torch==2.15.0 transformers==5.24.0", as the check below compares them.
want="$(grep -E '^[a-z]' "$req" | tr '\n' ' ' | sed 's/ $//')"
have() {
  "$venv/bin/python" - <<PY 2>/dev/null
import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("torch", "transformers")))
PY
}
if [ -x "$venv/bin/python" ] && [ "$(have)" = "$want" ] &&
   "$venv/bin/python" -c "import torch, transformers, grpc, numpy" 2>/dev/null; then
  echo "$venv/bin/python"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "epserve: creating $venv" >&2
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
echo "epserve: installing $want into $venv" >&2
"$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
"$venv/bin/python" -c "import torch, transformers, grpc, numpy"
echo "$venv/bin/python"
