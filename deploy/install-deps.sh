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
  g++-aarch64-linux-gnu qemu-user libabsl-dev:arm64 libgtest-dev:arm64
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "epserve: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# The arm64 libraries of the aarch64 test build (tests/portability/) come from Debian's
# multiarch: the architecture is added once (on an arm64 host they are the native packages).
if [[ " ${missing[*]}" == *":arm64"* ]] && [ "$(dpkg --print-architecture)" != arm64 ] &&
   ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
