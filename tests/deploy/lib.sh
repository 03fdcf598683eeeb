# Helpers of the deploy/ tests (sourced). Needs EPSERVE_BINARY and EPSERVE_VERIFY from ctest.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$root/deploy/env.sh"
dir="$(mktemp -d /tmp/epserve-deploy.XXXXXX)"
pids=()

fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.log; do [ -e "$f" ] && { echo "== $f" >&2; tail -n 80 "$f" >&2; }; done
  exit 1
}

# A TCP port nobody listens on now (the supervisor needs a fixed one: clients reconnect to
# the same address after a restart).
free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Processes below $1 (children, grandchildren, ...).
descendants() {
  local p
  for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done
}

# The pid of MPI rank $2 among the descendants of $1, other than $3 (when given). Waits for it
# up to $RANK_PID_TIMEOUT seconds (30 by default: a job's processes may still be starting or
# leaving when a test looks, above all on a loaded machine) and prints nothing when none came,
# or at once when $1 has exited. The environment is read by grep itself (-z: NUL-separated):
# piped from another process under pipefail, grep -q's early exit could kill the writer with
# SIGPIPE and fail the match it had found.
rank_pid() {
  local deadline=$((SECONDS + ${RANK_PID_TIMEOUT:-30})) p
  while :; do
    for p in $(descendants "$1"); do
      [ "$p" != "${3:-}" ] || continue
      if grep -qxz "OMPI_COMM_WORLD_RANK=$2" "/proc/$p/environ" 2>/dev/null; then
        case "$(readlink "/proc/$p/exe" 2>/dev/null)" in *epserve*) echo "$p"; return ;; esac
      fi
    done
    [ "$SECONDS" -lt "$deadline" ] && kill -0 "$1" 2>/dev/null || return 0
    sleep 0.1
  done
}

# Waits up to $2 seconds for file $1 to exist and be non-empty; gives up at once when process
# $3 (the supervisor) has exited.
wait_ready() {
  local i
  for i in $(seq 1 $(($2 * 10))); do
    [ -s "$1" ] && return 0
    kill -0 "$3" 2>/dev/null || { echo "process $3 exited before $1 appeared" >&2; return 1; }
    sleep 0.1
  done
  return 1
}

# Waits up to $3 seconds (30 by default) for a line of file $1 to match grep pattern $2: what
# the ranks print reaches the file through mpirun's forwarding, which may lag the ready file.
wait_log() {
  local deadline=$((SECONDS + ${3:-30}))
  until grep -q -- "$2" "$1" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

json_field() {  # json_field FILE EXPR: a Python expression over the object `j`
  /usr/bin/python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1"
}

now() { date +%s.%N; }

# Stops the background processes this test started, the supervisor first (it stops its job).
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

# Starts 4 verifying clients (5 s deadlines) against $1 until $dir/stop exists (answers summed
# into $dir/load.json; $load is their pid), lets them run 3 s, then kills MPI rank $3 under
# supervisor $2 with SIGKILL; sets $victim and $t_kill.
kill_rank_under_load() {
  # --duration bounds --until-file: its default (10 s) ended the load as a slow restart came
  # back, before any answer after the kill.
  "$EPSERVE_VERIFY" --target="$1" --concurrency=4 --deadline=5s --until-file="$dir/stop" \
    --duration=300s \
    >"$dir/load.json" 2>"$dir/load.log" &
  load=$!
  pids+=($load)
  sleep 3
  victim=$(rank_pid "$2" "$3")
  [ -n "$victim" ] || fail "cannot find rank $3"
  t_kill=$(now)
  kill -KILL "$victim"
  echo "killed rank $3 (pid $victim) under load"
}

# SIGTERM to supervisor $1 (its pid is taken off $pids); fails unless it exits 0 and reports
# that every rank left cleanly. Prints its log.
stop_supervisor_cleanly() {
  kill -TERM "$1"
  local code=0
  wait "$1" || code=$?
  pids=()
  cat "$dir/supervisor.log"
  [ "$code" = 0 ] || fail "the supervisor exited $code after SIGTERM"
  grep -q "stopped cleanly" "$dir/supervisor.log" || fail "no clean stop reported"
}
