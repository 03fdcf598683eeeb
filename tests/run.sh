#!/usr/bin/env bash
# The test command: installs what is missing (Debian's packages, and the example's PyPI ones
# in a virtual environment), builds with warnings as errors, and runs every test except the
# benchmarks (ctest label "bench").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/deploy/install-deps.sh"
# transformers and torch for examples_generate_test (a virtual environment outside the tree).
"$root/examples/install-deps.sh" >/dev/null
build="${BUILD_DIR:-$root/build}"
BUILD_DIR="$build" "$root/deploy/build.sh" -DEPSERVE_WERROR=ON
source "$root/deploy/env.sh"
cd "$build"
ctest -LE bench --output-on-failure --timeout 900 "$@"
