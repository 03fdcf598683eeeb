#!/usr/bin/env bash
# A stopped worker (SIGSTOP) through deploy/epserve-local on synthetic:tiny: gRPC health leaves
# SERVING and ServerReady turns false within 5 s (the workers' heartbeats;
# --worker-stall-timeout=2s), not at the exchange timeout, and returns to SERVING once the worker is continued (SIGCONT), when no
# batch had to wait for it meanwhile; the supervisor restarts nothing within its
# unhealthy_seconds. Prints the times.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'for p in ${stopped:-}; do kill -CONT $p 2>/dev/null || true; done; cleanup' EXIT
health="$(dirname "$EPSERVE_LOAD")/epserve-health"
port=$(free_port); metrics_port=$(free_port)
"$root/deploy/epserve-local" -w 2 --model=synthetic:tiny --grpc-address=127.0.0.1:$port \
  --metrics-address=127.0.0.1:$metrics_port --ready-file="$dir/ready.json" \
  --worker-stall-timeout=2s >"$dir/cluster.log" 2>"$dir/supervisor.log" &
supervisor=$!
pids+=($supervisor)
wait_ready "$dir/ready.json" 120 $supervisor || fail "cluster not ready"
"$health" --target=127.0.0.1:$port >/dev/null || fail "not SERVING after start"
rank0=$(rank_pid $supervisor 0)
worker=$(rank_pid $supervisor 2)
[ -n "$worker" ] && [ -n "$rank0" ] || fail "cannot find the ranks"

# ServerReady through the KServe protocol (True or False), as a client would ask it.
server_ready() {
  PYTHONPATH="$EPSERVE_PROTO_PY" /usr/bin/python3 -c "import grpc, grpc_service_pb2 as pb
ready = grpc.insecure_channel('127.0.0.1:$port').unary_unary(
    '/inference.GRPCInferenceService/ServerReady',
    request_serializer=pb.ServerReadyRequest.SerializeToString,
    response_deserializer=pb.ServerReadyResponse.FromString)
print(ready(pb.ServerReadyRequest(), timeout=2).ready)"
}

t_stop=$(now)
kill -STOP "$worker"
stopped=$worker
left=""
for _ in $(seq 1 50); do
  if ! "$health" --target=127.0.0.1:$port --timeout=1s >/dev/null; then left=$(now); break; fi
  sleep 0.1
done
[ -n "$left" ] || fail "health stayed SERVING 5 s after SIGSTOP of worker 1 (stall timeout 2 s)"
ready=$(server_ready) || fail "ServerReady did not answer while worker 1 was stopped"
[ "$ready" = False ] || fail "ServerReady said $ready while health was not SERVING"
sleep 1
kill -CONT "$worker"
stopped=""
t_cont=$(now)
back=""
for _ in $(seq 1 100); do
  if "$health" --target=127.0.0.1:$port --timeout=1s >/dev/null; then back=$(now); break; fi
  sleep 0.1
done
[ -n "$back" ] || fail "health did not return to SERVING 10 s after SIGCONT"
[ "$(server_ready)" = True ] || fail "ServerReady not true once health was SERVING again"
"$EPSERVE_VERIFY" --target=127.0.0.1:$port --requests=20 >"$dir/after.json" 2>"$dir/after.log" ||
  fail "answers after the stall: $(cat "$dir/after.json")"
[ "$(rank_pid $supervisor 0)" = "$rank0" ] || fail "rank 0 changed: the job was restarted"
grep -q "sent no heartbeat" "$dir/cluster.log" || fail "rank 0 did not say why it is not ready"
/usr/bin/python3 -c "import sys; a=[float(x) for x in sys.argv[1:]]; \
print(f'SIGSTOP of a worker: health left SERVING after {a[1]-a[0]:.2f} s (stall timeout 2 s); '
      f'SERVING again {a[3]-a[2]:.2f} s after SIGCONT; 20 correct answers after; no restart')" \
  "$t_stop" "$left" "$t_cont" "$back"
