#!/usr/bin/env bash
# Idle connections to /metrics against deploy/epserve-local (the supervisor) on synthetic:tiny:
# two connections that send half a request and then nothing, re-opened whenever the server
# closes them, for $1 seconds (default 20; 60 with label `long`), while a client checks every
# answer. The supervisor judges liveness by gRPC health, so nothing is restarted; scrapes are
# still answered; the reaped connections are counted.
set -euo pipefail
if [ "${2:-}" = --long ] && [ -z "${EPSERVE_LONG_TESTS:-}" ]; then
  echo "the long form runs with EPSERVE_LONG_TESTS=1"
  exit 77
fi
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap cleanup EXIT
seconds="${1:-20}"
port=$(free_port); metrics_port=$(free_port)
"$root/deploy/epserve-local" -w 2 --model=synthetic:tiny --grpc-address=127.0.0.1:$port \
  --metrics-address=127.0.0.1:$metrics_port --ready-file="$dir/ready.json" \
  --metrics-header-timeout=2s >"$dir/cluster.log" 2>"$dir/supervisor.log" &
supervisor=$!
pids+=($supervisor)
wait_ready "$dir/ready.json" 120 $supervisor || fail "cluster not ready"
rank0=$(rank_pid $supervisor 0)
[ -n "$rank0" ] || fail "cannot find rank 0 under the supervisor"
grep -q "liveness from /metrics" "$dir/supervisor.log" &&
  fail "the supervisor fell back to /metrics: $(grep liveness "$dir/supervisor.log")"

"$EPSERVE_VERIFY" --target=127.0.0.1:$port --concurrency=2 --duration=${seconds}s \
  --deadline=5s >"$dir/load.json" 2>"$dir/load.log" &
load=$!
pids+=($load)
/usr/bin/python3 - "$metrics_port" "$seconds" >"$dir/idle.txt" <<'PY' || fail "idle holder"
import socket, sys, time, urllib.request
port, seconds = int(sys.argv[1]), float(sys.argv[2])
def hold():
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    s.setblocking(False)
    return s
held, reopened, scrapes, worst = [hold(), hold()], 0, 0, 0.0
end = time.time() + seconds
while time.time() < end:
    for i, s in enumerate(held):
        try:
            if s.recv(1) == b"":  # closed by the server
                s.close(); held[i] = hold(); reopened += 1
        except BlockingIOError:
            pass
    t = time.time()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200 and b"epserve_workers_ready" in r.read()
    worst = max(worst, time.time() - t); scrapes += 1
    time.sleep(0.5)
print(f"{reopened} {scrapes} {worst * 1000:.1f}")
PY
wait $load || fail "wrong or failed answers while /metrics was held: $(cat "$dir/load.json")"
read -r reopened scrapes worst_ms <"$dir/idle.txt"
/usr/bin/python3 - "$dir/load.json" <<'PY' || fail "answers: $(cat "$dir/load.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["wrong"] == 0 and set(j["codes"]) == {"OK"}, j["codes"]
PY
[ "$(rank_pid $supervisor 0)" = "$rank0" ] || fail "rank 0 changed: the job was restarted"
grep -qE "failed after|not serving" "$dir/supervisor.log" &&
  fail "the supervisor judged the job unhealthy: $(grep -E 'failed after|not serving' "$dir/supervisor.log")"
reaped=$(curl -s "http://127.0.0.1:$metrics_port/metrics" |
  awk '/^epserve_metrics_http_connections_total\{event="header_timeout"\}/ {print $2}')
[ "${reaped%.*}" -ge 2 ] || fail "no reaped connection counted (header_timeout: '$reaped')"
echo "2 idle /metrics connections for ${seconds} s: ${reopened} reaped and re-opened (server" \
  "counted ${reaped%.*}), ${scrapes} scrapes answered (slowest ${worst_ms} ms), $(json_field \
  "$dir/load.json" "j['codes']['OK']") correct answers, 0 errors, no restart"
