#!/usr/bin/env bash
# A real Prometheus scrapes a running cluster with monitoring/'s config and rules; the test
# queries its HTTP API for a recording rule, and checks every name the rules and the
# dashboard use against the live scrape.
# usage: prometheus_e2e.sh EPSERVE_BINARY EPSERVE_LOAD_BINARY PROMETHEUS_BINARY
set -euo pipefail
epserve="$1"; load="$2"; prometheus="$3"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$root/deploy/env.sh"
dir="$(mktemp -d /tmp/epserve-prom.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$dir"/*.log; do echo "== $f" >&2; tail -n 20 "$f" >&2; done; exit 1; }

mpirun -np 3 --bind-to none "$epserve" --model=synthetic:tiny --grpc-address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --ready-file="$dir/ready.json" >"$dir/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 600); do [ -s "$dir/ready.json" ] && break; sleep 0.2; done
[ -s "$dir/ready.json" ] || fail "server not ready"
grpc=$(sed -E 's/.*"grpc": "([^"]+)".*/\1/' "$dir/ready.json")
metrics=$(sed -E 's/.*"metrics": "([^"]+)".*/\1/' "$dir/ready.json")

# Traffic during the whole test (bounded: 40 s at most).
"$load" --target="$grpc" --tokens=8 --concurrency=2 --duration=40s --warmup=0s >"$dir/load.log" 2>&1 &
pids+=($!)

# Every name the rules and the dashboard use is exported.
sleep 2
curl -sf "http://$metrics/metrics" >"$dir/scrape.txt" || fail "cannot scrape $metrics"
/usr/bin/python3 "$root/tests/monitoring/check_metric_names.py" "$root/monitoring" "$dir/scrape.txt" \
  || fail "the rules or the dashboard name metrics the server does not export"

# Prometheus with the project's config, pointed at the cluster, scraping every second.
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
sed -e "s|127.0.0.1:8002|$metrics|" -e "s|scrape_interval: .*|scrape_interval: 1s|" \
    -e "s|evaluation_interval: .*|evaluation_interval: 1s|" \
    -e "s|  - rules/|  - $root/monitoring/rules/|" "$root/monitoring/prometheus.yml" >"$dir/prometheus.yml"
"$prometheus" --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
  --web.listen-address="127.0.0.1:$port" >"$dir/prometheus.log" 2>&1 &
pids+=($!)

query() {
  curl -sf --get "http://127.0.0.1:$port/api/v1/query" --data-urlencode "query=$1" 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null || true
}
value=""
for _ in $(seq 1 60); do
  value=$(query 'epserve:tokens:rate1m')
  [ -n "$value" ] && [ "$value" != "0" ] && break
  sleep 1
done
[ -n "$value" ] && [ "$value" != "0" ] || fail "recording rule epserve:tokens:rate1m has no value"
up=$(query 'up{job="epserve"}')
[ "$up" = "1" ] || fail "target not up ($up)"
echo "ok: Prometheus scraped the cluster; epserve:tokens:rate1m = $value tokens/s"
