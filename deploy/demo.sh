#!/usr/bin/env bash
# The demo: installs what is missing, builds, starts a local cluster (front-end + 2
# workers) on a real model's layer shape, sends it a short load from epserve-load, prints
# what it measured, and stops the cluster.
#   deploy/demo.sh [--model synthetic:<preset>] [--duration 10s] [--concurrency 1,4] [--tokens 16]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model="synthetic:qwen1.5-moe-a2.7b"; duration="10s"; concurrency="1,4"; tokens="16"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --tokens) tokens="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

"$root/deploy/install-deps.sh"
echo "== building"
"$root/deploy/build.sh"
build="${BUILD_DIR:-$root/build}"
source "$root/deploy/env.sh"
export EPSERVE_KERNEL_CACHE="${EPSERVE_KERNEL_CACHE:-$build/kernel-cache}"
export POCL_CACHE_DIR="${POCL_CACHE_DIR:-$EPSERVE_KERNEL_CACHE/pocl}"  # PoCL's compiled kernels

run_dir="$(mktemp -d /tmp/epserve-demo.XXXXXX)"
echo "== starting 1 front-end + 2 workers on $model (log: $run_dir/server.log)"
"$root/deploy/epserve-local" -w 2 --model="$model" --grpc-address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --ready-file="$run_dir/ready.json" >"$run_dir/server.log" 2>&1 &
server=$!
stop_server() {
  if kill -0 "$server" 2>/dev/null; then
    kill -TERM "$server" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$server" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server" 2>/dev/null || true
  fi
  wait "$server" 2>/dev/null || true
}
trap stop_server EXIT

for _ in $(seq 1 600); do
  [ -s "$run_dir/ready.json" ] && break
  if ! kill -0 "$server" 2>/dev/null; then cat "$run_dir/server.log"; echo "server failed to start" >&2; exit 1; fi
  sleep 0.5
done
[ -s "$run_dir/ready.json" ] || { cat "$run_dir/server.log"; echo "server not ready in 300 s" >&2; exit 1; }
grpc=$(sed -E 's/.*"grpc": "([^"]+)".*/\1/' "$run_dir/ready.json")
metrics=$(sed -E 's/.*"metrics": "([^"]+)".*/\1/' "$run_dir/ready.json")
grep -E "model |worker " "$run_dir/server.log" || true
echo "== serving on $grpc; load: $tokens tokens per request, concurrency $concurrency, $duration per step"
"$build/client/epserve-load" --target="$grpc" --tokens="$tokens" --concurrency="$concurrency" \
  --duration="$duration" --warmup=2s

echo "== server-side stage latency (mean over the run, from http://$metrics/metrics)"
curl -s "http://$metrics/metrics" | awk '
  /^epserve_stage_duration_seconds_sum/ { match($0, /stage="[a-z_]+"/); s=substr($0, RSTART+7, RLENGTH-8);
    match($0, /rank="[0-9]+"/); r=substr($0, RSTART+6, RLENGTH-7); sum[s" rank "r]=$NF }
  /^epserve_stage_duration_seconds_count/ { match($0, /stage="[a-z_]+"/); s=substr($0, RSTART+7, RLENGTH-8);
    match($0, /rank="[0-9]+"/); r=substr($0, RSTART+6, RLENGTH-7); cnt[s" rank "r]=$NF }
  /^epserve_batch_tokens_sum/ { bt=$NF } /^epserve_batch_tokens_count/ { bc=$NF }
  END { for (k in sum) if (cnt[k] > 0) printf "  %-22s %9.3f ms\n", k, 1000*sum[k]/cnt[k];
        if (bc > 0) printf "  batches: %d, mean %.1f tokens per batch\n", bc, bt/bc }' | sort
echo "== stopping the cluster"
stop_server
trap - EXIT
echo "== done"
