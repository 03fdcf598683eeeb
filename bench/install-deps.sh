#!/usr/bin/env bash
# What the benchmarks need beyond deploy/install-deps.sh: PyTorch for the end-to-end
# comparison (Debian's python3-torch, CPU). Not installed by the test command, to keep CI's
# install step small.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/deploy/install-deps.sh"
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends python3-torch >/dev/null
fi
