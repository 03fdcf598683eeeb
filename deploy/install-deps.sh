#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build, test and run epserve.
# Idempotent: does nothing when every package is already there.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libopenmpi-dev openmpi-bin
  ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libopenblas-dev
  prometheus python3
  clang libclang-rt-14-dev
  python3-grpcio python3-numpy python3-protobuf python3-venv openssl
  python3-yaml iproute2 bc procps
  g++-aarch64-linux-gnu
)
# The aarch64 unit-test run (tests/portability/aarch64_run_test.sh, which skips without
# them): installed when the package mirror serves arm64, else left out with a warning.
CROSS_PACKAGES=(qemu-user libabsl-dev:arm64 libgtest-dev:arm64)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
cross_missing=()
for p in "${CROSS_PACKAGES[@]}"; do installed "$p" || cross_missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ] && [ ${#cross_missing[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ]; then
  echo "epserve: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ${#cross_missing[@]} -gt 0 ]; then
  # The arm64 libraries come from Debian's multiarch: the architecture is added once (on an
  # arm64 host they are the native packages). If the mirror cannot serve them, the
  # architecture is taken out again so that later apt runs are not affected.
  added=0
  if [[ " ${cross_missing[*]}" == *":arm64"* ]] && [ "$(dpkg --print-architecture)" != arm64 ] &&
     ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    added=1
  fi
  echo "epserve: installing ${cross_missing[*]} (aarch64 test run)" >&2
  if ! { $SUDO apt-get update -qq &&
         $SUDO apt-get install -y -qq --no-install-recommends "${cross_missing[@]}" >/dev/null; }; then
    echo "epserve: warning: could not install ${cross_missing[*]}; portability_aarch64_run_test" \
      "will be skipped" >&2
    if [ $added -eq 1 ]; then
      $SUDO dpkg --remove-architecture arm64 || true
      $SUDO apt-get update -qq || true
    fi
  fi
fi
