#!/usr/bin/env bash
# Serving through a worker's death under deploy/epserve-local (the supervisor runs mpirun
# --enable-recovery): 3 workers on synthetic:tiny, every expert on two of them
# (--redundant-experts=8 --eplb-min-copies=2 --shared-expert=owner). A kill -9 of worker
# rank 2 under 4 verifying clients:
#  * no wrong or late answer, at most the 4 requests in flight at the death and the 4 at the
#    handover fail, health stays SERVING until the supervisor drains the degraded job, rank 0
#    reports epserve_workers_lost 1;
#  * the supervisor starts a replacement job on the same addresses and, once it serves,
#    stops the degraded one: the service has every worker again (epserve_workers_ready 3,
#    epserve_workers_lost 0), rank 0 is a new process, answers stay correct throughout;
#  * a clean stop.
# Prints the figures (README's reliability table).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap cleanup EXIT

port=$(free_port); metrics_port=$(free_port)
"$root/deploy/epserve-local" -w 3 --model=synthetic:tiny --grpc-address=127.0.0.1:$port \
  --metrics-address=127.0.0.1:$metrics_port --ready-file="$dir/ready.json" \
  --max-batch-tokens=32 --redundant-experts=8 --eplb-min-copies=2 --shared-expert=owner \
  >"$dir/cluster.log" 2>"$dir/supervisor.log" &
supervisor=$!
pids+=($supervisor)
wait_ready "$dir/ready.json" 120 $supervisor || fail "cluster not ready"
grep -q -- "--enable-recovery" "$dir/supervisor.log" || fail "mpirun ran without --enable-recovery"
target=127.0.0.1:$port
metrics_url="http://127.0.0.1:$metrics_port/metrics"
gauge() {  # gauge NAME: its value on /metrics, or "" when nothing answers
  /usr/bin/python3 - "$metrics_url" "$1" <<'EOF' 2>/dev/null || true
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()
m = re.search(rf"^{sys.argv[2]} ([0-9.eE+-]+)$", text, re.M)
print(m.group(1) if m else "")
EOF
}
rank0=$(rank_pid $supervisor 0)

kill_rank_under_load $target $supervisor 2  # worker 1

# The job serves on degraded: rank 0 says so at once (polled from one process: a Python
# start per scrape would measure itself).
t_degraded=$(/usr/bin/python3 - "$metrics_url" <<'EOF'
import re, sys, time, urllib.request
for _ in range(500):
    try:
        text = urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()
        if re.search(r"^epserve_workers_lost 1$", text, re.M):
            print(f"{time.time():.3f}")
            break
    except OSError:
        pass
    time.sleep(0.01)
EOF
)
[ -n "$t_degraded" ] || fail "rank 0 did not report the lost worker"
# The supervisor replaces the job: a new one serves, then the old one is drained.
t_drain=""; t_replaced=""
for _ in $(seq 1 1200); do
  if [ -z "$t_drain" ] && grep -q "stopping job 1" "$dir/supervisor.log"; then t_drain=$(now); fi
  if grep -q "serves in its place" "$dir/supervisor.log"; then t_replaced=$(now); break; fi
  sleep 0.05
done
[ -n "$t_replaced" ] || fail "the supervisor did not replace the degraded job"
[ -n "$t_drain" ] || t_drain=$t_replaced
t_new_serving=$(grep -c "is serving on" "$dir/supervisor.log")
[ "$t_new_serving" -ge 2 ] || fail "no second job served"
sleep 3
touch "$dir/stop"
wait $load || fail "wrong or late answers around the kill: $(cat "$dir/load.json")"
cat "$dir/load.json"
new_rank0=$(rank_pid $supervisor 0 "$rank0")
[ -n "$new_rank0" ] && [ "$new_rank0" != "$rank0" ] || fail "rank 0 is not a new process"
ready=$(gauge epserve_workers_ready); lost=$(gauge epserve_workers_lost)
[ "$ready" = "3" ] && [ "$lost" = "0" ] ||
  fail "after the replacement: workers ready '$ready', lost '$lost'"
grep -q "failed after" "$dir/supervisor.log" && fail "the supervisor restarted a failed job"
# When the supervisor began to drain the old job: its "stopping job 1" line came after the
# new job served; health answers up to then must all be SERVING.
/usr/bin/python3 - "$dir/load.json" "$t_kill" "$t_degraded" "$t_drain" "$t_replaced" <<'EOF' ||
import json, sys
j = json.load(open(sys.argv[1]))
t_kill, t_degraded, t_drain, t_replaced = map(float, sys.argv[2:6])
codes = j["codes"]
failed = sum(v for k, v in codes.items() if k != "OK")
assert j["wrong"] == 0, f"wrong answers: {j['wrong_example']}"
assert j["late"] == 0, f"{j['late']} answers came after their deadline"
# At most the 4 requests in flight when the worker died, and the 4 in flight when the old
# job's drain began (gRPC cancels calls it received but had not handed over, grpc#41785).
assert failed <= 8, f"{failed} requests failed: {codes} {j['error_examples']}"
assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, f"unexpected codes {codes}"
health = j["health"]
# Health as the client saw it from the kill until the supervisor began to drain the old job
# (the drain shows NOT_SERVING on a connection that was to it).
before = [s for t, s in health if t_kill <= t < t_drain]
assert all(s == "SERVING" for s in before), f"health left SERVING after the kill: {health}"
print(f"kill -9 of a worker with every expert on two workers: requests per code {codes}, "
      f"wrong 0, late 0; degraded reported after {t_degraded - t_kill:.2f} s; replacement "
      f"job serving {t_drain - t_kill:.1f} s and the old one drained {t_replaced - t_kill:.1f} "
      f"s after the kill; "
      f"health transitions {[(round(t - t_kill, 2), s) for t, s in health if t >= t_kill]}")
EOF
  fail "degraded-serving properties"
echo "after the replacement: epserve_workers_ready $ready, epserve_workers_lost $lost, rank 0" \
  "pid $rank0 -> $new_rank0"

stop_supervisor_cleanly $supervisor
echo "ok"
