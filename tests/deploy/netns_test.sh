#!/usr/bin/env bash
# Across hosts: rank 0 and two workers, each in a network namespace of its own (veth pairs on
# a bridge, 10.200.N.0/24), started by deploy/epserve-local through an Open MPI launch agent
# that runs each daemon with `ip netns exec`. Open MPI talks TCP only, the heap is --heap=rma
# (osc/pt2pt over TCP). A client in the root namespace checks every answer against the
# reference. Exit 77 (ctest SKIP) where namespaces cannot be made.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
tag="ep$(($$ % 100000))"
namespaces=()
teardown() {
  cleanup
  local ns
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "${tag}br" 2>/dev/null || true
}
trap teardown EXIT

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no 'ip' command (Debian package iproute2)"
ip netns add "${tag}1" 2>"$dir/netns.err" || skip "cannot create a network namespace: $(cat "$dir/netns.err")"
namespaces+=("${tag}1")

# A /24 of 10.200.0.0/16 that no route of the root namespace uses yet.
subnet=""
for _ in $(seq 1 50); do
  n=$((RANDOM % 250 + 1))
  grep -q "^10\.200\.$n\." <<<"$(ip route show)" || { subnet="10.200.$n"; break; }
done
[ -n "$subnet" ] || fail "no free 10.200.N.0/24"
ip link add "${tag}br" type bridge
ip addr add "$subnet.254/24" dev "${tag}br"
ip link set "${tag}br" up
for i in 1 2 3; do
  ns="${tag}$i"
  [ "$i" = 1 ] || { ip netns add "$ns"; namespaces+=("$ns"); }
  ip link add "${tag}h$i" type veth peer name "${tag}n$i"
  ip link set "${tag}h$i" master "${tag}br"
  ip link set "${tag}h$i" up
  ip link set "${tag}n$i" netns "$ns"
  ip -n "$ns" addr add "$subnet.$i/24" dev "${tag}n$i"
  ip -n "$ns" link set "${tag}n$i" up
  ip -n "$ns" link set lo up
done
echo "namespaces ${namespaces[*]} on $subnet.0/24 (bridge ${tag}br, $subnet.254)"

# Open MPI's rsh launch agent: `agent [options] HOST COMMAND...`; HOST is an address of the
# hostfile, whose last byte names the namespace. Each namespace is a host of its own, with a
# hostname of its own (a UTS namespace): Open MPI keys its per-host session directory
# (/tmp/ompi.HOST.UID, with the daemon's topology file hwloc.sm and PMIx's stores) by
# hostname, so daemons that shared one would share one host's files, which no real cluster
# does (with them shared, a CI run lost a daemon to SIGSEGV at start-up, and the job with it).
cat >"$dir/agent.sh" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
ns="${tag}\${host##*.}"
exec ip netns exec "\$ns" unshare --uts /bin/sh -c "hostname \$ns-host || exit 1; \$*"
EOF
chmod +x "$dir/agent.sh"
printf '%s slots=1\n' "$subnet.1" "$subnet.2" "$subnet.3" >"$dir/hostfile"

port=$(free_port); metrics_port=$(free_port)
cat >"$dir/cluster.toml" <<EOF
[launcher]
workers = 2
hostfile = "$dir/hostfile"
health_host = "$subnet.1"
mpirun_args = ["--bind-to", "none", "--mca", "plm_rsh_agent", "$dir/agent.sh",
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", "$subnet.0/24",
               "--mca", "oob_tcp_if_include", "$subnet.0/24", "--mca", "osc", "pt2pt"]
[epserve]
model = "synthetic:tiny"
heap = "rma"
grpc-address = "0.0.0.0:$port"
metrics-address = "0.0.0.0:$metrics_port"
ready-file = "$dir/ready.json"
max-batch-tokens = 32
EOF
"$root/deploy/epserve-local" --config "$dir/cluster.toml" >"$dir/cluster.log" 2>"$dir/supervisor.log" &
supervisor=$!
pids+=($supervisor)
wait_ready "$dir/ready.json" 180 $supervisor || fail "cluster not ready"
wait_log "$dir/cluster.log" "^\[epserve rank 0\] heap rma" || fail "the heap is not rma"

# Every rank runs in its own namespace.
declare -A seen
for r in 0 1 2; do
  p=$(rank_pid $supervisor $r)
  [ -n "$p" ] || fail "cannot find rank $r"
  netns=$(readlink "/proc/$p/ns/net")
  [ -z "${seen[$netns]:-}" ] || fail "ranks ${seen[$netns]} and $r share $netns"
  seen[$netns]=$r
  grep -qx "${tag}$((r + 1))" <<<"$(ip netns identify "$p")" || fail "rank $r is not in ${tag}$((r + 1))"
  [ "$(nsenter --target "$p" --uts hostname)" = "${tag}$((r + 1))-host" ] ||
    fail "rank $r does not run on host ${tag}$((r + 1))-host"
done
echo "ranks 0, 1, 2 run in ${tag}1, ${tag}2, ${tag}3"

start=$(now)
"$EPSERVE_VERIFY" --target="$subnet.1:$port" --requests=60 --concurrency=3 --deadline=30s \
  --late-slack=5s >"$dir/verify.json" 2>"$dir/verify.log" ||
  fail "answers across namespaces: $(cat "$dir/verify.json")"
elapsed=$(echo "$(now) - $start" | bc)
json_field "$dir/verify.json" \
  "f\"across namespaces (TCP, --heap=rma): {j['codes']} correct of {j['requests']} requests, p50 {j['p50_ok_latency_ms']} ms, max {j['max_ok_latency_ms']} ms\""
echo "60 requests in $elapsed s"

kill -TERM $supervisor
code=0
wait $supervisor || code=$?
pids=()
tail -n 3 "$dir/supervisor.log"
[ "$code" = 0 ] || fail "the cluster did not stop cleanly (exit $code)"
echo "ok"
