#!/usr/bin/env bash
# The layers of docs/ARCHITECTURE.md ("Dependencies run one way"), checked on the sources'
# #include lines, and on the front-end's test binary: which folder may include which, that no
# folder reaches another's detail/ headers, that OpenCL headers stay in kernels/ and MPI's in
# shmem/ (and app/, the executable, which starts MPI), and that the front-end library and its tests link
# no OpenCL. Fails naming each include that breaks a rule.
#   layering_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
cd "$src"

# folder (or file) -> the project folders it may include from, besides itself.
declare -A allowed=(
  [common]=""
  [model]="common"
  [shmem]="common"
  [kernels]="common model"
  [worker]="common shmem"          # the exchange protocol; worker.{h,cc} below
  [worker/worker]="common model shmem kernels"
  [server]="common model shmem worker"  # worker's protocol headers only, checked below
  [app]="common model shmem kernels worker server"
  [client]="common model"
  [tools]="common model worker"   # worker/placement.h only (header-only), checked below
)
# The worker's own files, which the front-end library must not include (they need OpenCL).
worker_only='worker/(worker|device_exchange|worker_options)\.h'
# What tools may read of worker/: the rank mapping, constexpr in its header (no MPI linked).
tools_worker='worker/placement\.h'

failed=0
fail() { echo "layering: $*"; failed=$((failed + 1)); }

for file in $(ls common/*.{h,cc} common/detail/*.{h,cc} model/*.{h,cc} model/detail/*.{h,cc} \
                 shmem/*.{h,cc} shmem/detail/*.{h,cc} kernels/*.{h,cc} kernels/detail/*.{h,cc} \
                 worker/*.{h,cc} server/*.{h,cc} app/*.{h,cc} client/*.{h,cc} tools/*.cc 2>/dev/null); do
  folder="${file%%/*}"
  key="$folder"
  case "$file" in
    worker/worker.h | worker/worker.cc | worker/device_exchange.h | worker/device_exchange.cc | \
      worker/worker_options.h | worker/worker_options.cc)
      key=worker/worker ;;
  esac
  while IFS= read -r line; do
    inc="$(sed -E 's/^#include "([^"]+)".*/\1/' <<<"$line")"
    other="${inc%%/*}"
    [ "$other" = "$inc" ] && continue           # generated protobuf headers, no folder
    case "$other" in absl | grpcpp | prometheus | gtest | gmock) continue ;; esac
    [ "$other" = "$folder" ] && continue
    if [[ "$inc" == */detail/* ]]; then
      fail "$file includes $inc: another folder's private header"
      continue
    fi
    if [[ " ${allowed[$key]} " != *" $other "* ]]; then
      fail "$file includes $inc: $key may include from {${allowed[$key]:-nothing}} only"
      continue
    fi
    if [ "$key" = server ] && [[ "$inc" =~ $worker_only ]]; then
      fail "$file includes $inc: the front-end library uses the exchange protocol, not the worker"
    fi
    if [ "$key" = tools ] && [ "$other" = worker ] && ! [[ "$inc" =~ ^${tools_worker}$ ]]; then
      fail "$file includes $inc: tools read only worker/placement.h of worker/"
    fi
  done < <(grep -E '^#include "' "$file" || true)
  if [ "$folder" != kernels ] && grep -qE '^#include <CL/' "$file"; then
    fail "$file includes an OpenCL header: only kernels/ knows OpenCL"
  fi
  if [ "$folder" != shmem ] && [ "$folder" != app ] && grep -qE '^#include <mpi\.h>' "$file"; then
    fail "$file includes mpi.h: only shmem/ (and app/, which starts MPI) knows MPI"
  fi
done

# The front-end library's test binary links no OpenCL: its link step's inputs, as the build
# wrote them.
if [ -f "$build/build.ninja" ]; then
  link="$(grep -m1 -E '^build tests/server/server_test[ :]' "$build/build.ninja" || true)"
  if [ -z "$link" ]; then
    fail "no link line for tests/server/server_test in $build/build.ninja"
  elif grep -qiE 'OpenCL|epserve_kernels|epserve_worker\.a' <<<"$link"; then
    fail "server_test (the front-end library) links OpenCL or the worker: $link"
  fi
else
  echo "layering: $build/build.ninja not found (not a Ninja build): link line not checked"
fi

echo "layering: $failed violation(s)"
[ "$failed" -eq 0 ]
