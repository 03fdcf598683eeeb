#!/usr/bin/env bash
# Hostile clients against deploy/epserve-local on synthetic:tiny (tests/deploy/hostile.py):
# slowloris and idle connections on both ports, abandoned streams, a cancel storm, streams
# that never read their answers, a 1 GiB message, a client that never acknowledges SETTINGS,
# garbage bytes, 1 MiB strings. Each attack runs while epserve-verify checks every answer;
# /metrics must keep answering within 1 s and rank 0's resident memory must stay within the
# stated bound over idle. $1: short (default) or full (label long, EPSERVE_LONG_TESTS=1);
# EPSERVE_HOSTILE_ONLY=name,name runs only those attacks.
set -euo pipefail
form="${1:-short}"
if [ "$form" = full ] && [ -z "${EPSERVE_LONG_TESTS:-}" ]; then
  echo "the full form runs with EPSERVE_LONG_TESTS=1"
  exit 77
fi
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap cleanup EXIT
port=$(free_port); metrics_port=$(free_port)
# The memory bound: --max-inflight-bytes (64 MiB, derived for tiny) + gRPC's quota (96 MiB,
# derived) + what a burst of streams costs gRPC before the stream guard closes their
# connection (the settings attack: about 12 KiB a stream; the guard looks every 100 ms).
budget_mib=400
"$root/deploy/epserve-local" -w 2 --model=synthetic:tiny --grpc-address=127.0.0.1:$port \
  --metrics-address=127.0.0.1:$metrics_port --ready-file="$dir/ready.json" \
  --grpc-handshake-timeout=5s --metrics-header-timeout=2s --grpc-max-connections=512 \
  >"$dir/cluster.log" 2>"$dir/supervisor.log" &
supervisor=$!
pids+=($supervisor)
wait_ready "$dir/ready.json" 120 $supervisor || fail "cluster not ready"
rank0=$(rank_pid $supervisor 0)
[ -n "$rank0" ] || fail "cannot find rank 0 under the supervisor"
EPSERVE_PROTO_PY="$EPSERVE_PROTO_PY" /usr/bin/python3 "$root/tests/deploy/hostile.py" \
  --grpc=127.0.0.1:$port --metrics=127.0.0.1:$metrics_port --rank0-pid=$rank0 \
  --verify="$EPSERVE_VERIFY" --form=$form --rss-budget-mib=$budget_mib \
  --json="$dir/hostile.json" ${EPSERVE_HOSTILE_ONLY:+--only=$EPSERVE_HOSTILE_ONLY} | tee "$dir/hostile.log" || fail "hostile clients: see above"
[ "$(rank_pid $supervisor 0)" = "$rank0" ] || fail "rank 0 changed: the job was restarted"
