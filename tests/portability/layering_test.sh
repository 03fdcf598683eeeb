#!/usr/bin/env bash
# The layers of docs/ARCHITECTURE.md ("Dependencies run one way") where the build cannot hold
# them (cmake/IncludeRoots.cmake makes an include of a target not linked a compile error):
# on the sources' #include lines, which folder may include which (two targets of one folder
# share a root), that no folder reaches another's detail/ headers, that OpenCL headers stay in
# kernels/ and MPI's in shmem/ (and app/, the executable, which starts MPI); on the build's
# code model, which libraries each library depends on and that the front-end library and its
# tests link no OpenCL. Fails naming each include or dependency that breaks a rule.
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
worker_only='worker/(worker|device_exchange|worker_options|cuda_rows|host_rows|client_segments)\.h'
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
    worker/worker.h | worker/worker*.cc | worker/device_exchange.h | worker/device_exchange.cc | \
      worker/cuda_rows.h | worker/cuda_rows.cc | worker/host_rows.h | worker/host_rows.cc | worker/client_segments.* | \
      worker/worker_options.h)
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

# What the include roots cannot see: which libraries each target depends on and what the
# front-end's test binary links, from CMake's file API (any generator; the top CMakeLists.txt
# asks for the code model and deploy/build.sh before the first configure), else from
# build.ninja. The include roots make an include across the layers a compile error, but a
# folder's two targets share one root (worker/: the exchange protocol and the worker), and a
# link dependency can be added without any include.
reply="$build/.cmake/api/v1/reply"
if ls "$reply"/index-*.json >/dev/null 2>&1; then
  while IFS= read -r line; do fail "$line"; done < <(/usr/bin/python3 - "$reply" <<'EOF'
import glob, json, os, sys
reply = sys.argv[1]
index = json.load(open(sorted(glob.glob(os.path.join(reply, "index-*.json")))[-1]))
codemodel = next(o for o in index["objects"] if o["kind"] == "codemodel")
config = json.load(open(os.path.join(reply, codemodel["jsonFile"])))["configurations"][0]
names = {t["id"]: t["name"] for t in config["targets"]}
# Library -> the project libraries it may depend on (directly or not): the layers of
# docs/ARCHITECTURE.md.
allowed = {
    "epserve_common": set(),
    "epserve_model": {"epserve_common"},
    "epserve_shmem": {"epserve_common"},
    "epserve_kernels": {"epserve_common", "epserve_model"},
    "epserve_exchange": {"epserve_common", "epserve_shmem"},
    "epserve_worker": {"epserve_common", "epserve_model", "epserve_shmem", "epserve_kernels",
                       "epserve_exchange"},
    "epserve_server": {"epserve_common", "epserve_model", "epserve_shmem", "epserve_exchange",
                       "epserve_proto"},
    "epserve_client": {"epserve_common", "epserve_model", "epserve_proto"},
}
seen = set()
for t in config["targets"]:
    target = json.load(open(os.path.join(reply, t["jsonFile"])))
    deps = {names[d["id"]] for d in target.get("dependencies", [])}
    name = t["name"]
    seen.add(name)
    if name in allowed:
        for d in sorted(deps - allowed[name] - {"epserve_warnings"}):
            if d.startswith("epserve_"):
                print(f"{name} depends on {d}: it may depend on "
                      f"{{{', '.join(sorted(allowed[name]))}}} only")
    if name == "server_test":
        link = " ".join(f["fragment"] for f in target.get("link", {}).get("commandFragments", []))
        for bad in ("epserve_kernels", "epserve_worker"):
            if bad in deps:
                print(f"server_test (the front-end library) depends on {bad}")
        if "opencl" in link.lower() or "libepserve_worker" in link or "libepserve_kernels" in link:
            print(f"server_test (the front-end library) links OpenCL or the worker: {link}")
for name in ("server_test", *allowed):
    if name not in seen:
        print(f"no target {name} in CMake's code model")
EOF
)
elif [ -f "$build/build.ninja" ]; then
  echo "layering: no CMake file API reply in $build: server_test's link checked in build.ninja only"
  link="$(grep -m1 -E '^build tests/server/server_test[ :]' "$build/build.ninja" || true)"
  if [ -z "$link" ]; then
    fail "no link line for tests/server/server_test in $build/build.ninja"
  elif grep -qiE 'OpenCL|epserve_kernels|epserve_worker\.a' <<<"$link"; then
    fail "server_test (the front-end library) links OpenCL or the worker: $link"
  fi
else
  fail "neither CMake's file API reply nor build.ninja in $build: link lines not checked"
fi

echo "layering: $failed violation(s)"
[ "$failed" -eq 0 ]
