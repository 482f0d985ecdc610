#!/usr/bin/env bash
# The job manager end to end on pretend VMs (local provider), with the GPT example:
#   1. a job submitted without a calibration is calibrated once on its first VM (varuna-profile),
#   2. it starts on the 2 VMs the "cloud" has, then grows onto 4 when spot capacity comes back,
#   3. one VM is killed with kill -9 (an eviction without notice) and the job morphs around it,
#   4. the job finishes, and `varuna-manager events` tells the story.
# Everything lands in runs/demo-manager/ (RUN_DIR=... to change): manager.log, the job's VM
# directories (agent, worker and profiler logs) under manager.sqlite.d/, metrics.jsonl.
# STEPS=... sets the training length (default 300, a few minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
RUN=${RUN_DIR:-runs/demo-manager}
STEPS=${STEPS:-300}
rm -rf "$RUN"
mkdir -p "$RUN"
RUN=$(cd "$RUN" && pwd)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
manager() { "$PY" -m manager.cli "$@"; }
# wait_until SECONDS WHAT COMMAND...: poll COMMAND every half second; fail after SECONDS.
wait_until() {
    local limit=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "demo_manager: timed out after ${limit} s waiting for $what (see $RUN/manager.log)" >&2
            exit 1
        fi
        sleep 0.5
    done
}
# count_events KIND [TEXT]: how many events of KIND (whose message contains TEXT) the job has.
count_events() {
    manager events "$JOB" --json --kind "$1" | grep -c -- "${2:-}" || true
}
has_events() { (($(count_events "$@") >= ${N:-1})); }
# status_field EXPR: a Python expression over the job's status `s` (a dict, from status --json).
status_field() {
    manager status "$JOB" --json |
        "$PY" -c "import json, sys; s = json.load(sys.stdin)[0]; print($1)"
}
step_at_least() { (($(status_field 'int(s.get("step", 0))') >= $1)); }
finished() { [ "$(status_field 's["state"]')" = finished ]; }

"$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$RUN/token"
chmod 600 "$RUN/token"
PORT=$("$PY" -c 'from manager.common.procs import find_free_port; print(find_free_port("127.0.0.1"))')
export VARUNA_MANAGER=127.0.0.1:$PORT VARUNA_MANAGER_TOKEN_FILE=$RUN/token
echo 2 >"$RUN/capacity" # the pretend cloud has 2 spot VMs for us, for now

say "varuna-manager serve (log: $RUN/manager.log)"
"$PY" -m manager.cli serve --db "$RUN/manager.sqlite" --listen "$VARUNA_MANAGER" --token-file "$RUN/token" \
    --heartbeat-interval 0.5 --heartbeat-timeout 5 --create-retry 2 --grow-cooldown 3 \
    --gather-timeout 30 --orphan-timeout 120 --slow-threshold-pct 300 >"$RUN/manager.log" 2>&1 &
# (--slow-threshold-pct 300: this model's micro-batches take milliseconds, and on a shared
# 2-core machine a pretend VM is often 50 % slower than its peers for a few steps without being
# a fail-stutter VM; the default 50 % would take healthy VMs out of the demo.)
MANAGER_PID=$! # python itself (not a subshell), so that the cleanup below stops it
JOB=""
cleanup() {
    # A job left running (the demo failed half-way) is cancelled, so no pretend VM outlives it.
    if [ -n "$JOB" ] && ! finished; then
        manager cancel "$JOB" || true
        for _ in $(seq 1 60); do
            case "$(status_field 's["state"]' 2>/dev/null)" in cancelled | failed | finished) break ;; esac
            sleep 0.5
        done
    fi
    kill "$MANAGER_PID" 2>/dev/null || true
    wait "$MANAGER_PID" 2>/dev/null || true
}
trap 'status=$?; cleanup; exit $status' EXIT
wait_until 30 "the manager to answer" manager status

cat >"$RUN/job.toml" <<EOF
name = "gpt-demo"
script = "$ROOT/examples/gpt2/train.py"
args = ["--steps", "$STEPS", "--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--global-batch-size", "24", "--micro-batch-size", "2", "--eval-every", "0",
        "--metrics-out", "$RUN/metrics.jsonl"]
global_batch_size = 24
micro_batch_size = 2
checkpoint_dir = "$RUN/ckpt"
checkpoint_every = 10
min_vms = 2
max_vms = 4
target_steps = $STEPS
provider_options = { capacity_file = "$RUN/capacity" }

[env]
OMP_NUM_THREADS = "1"

# No calibration file: the manager calibrates once on the first VM (a cheap profile here).
[profile]
model = "$ROOT/examples/gpt2/profile_target.py:build"
model_args = { n_layer = 4, n_embd = 32, n_head = 2, block_size = 32 }
args = ["--procs", "1", "--reps", "3", "--warmup", "1", "--host-emulation", "loopback"]
timeout_s = 300
EOF

say "varuna-manager submit $RUN/job.toml"
JOB=$(manager submit "$RUN/job.toml")
echo "job $JOB"

say "1. calibration on the first VM (varuna-profile)"
wait_until 300 "the calibration" has_events calibration-finished
manager events "$JOB" --kind calibration-started --kind calibration-finished --kind calibration-failed
wait_until 180 "training to start" step_at_least 1
manager status "$JOB" --history 3

say "2. spot capacity comes back: 4 VMs (the manager asks again every 2 s and grows)"
echo 4 >"$RUN/capacity"
wait_until 240 "the grow morph" has_events resumed grow
manager events "$JOB" --kind vm-requested --kind stopping --kind launched --kind resumed | tail -n 4
wait_until 120 "a few steps on the grown job" step_at_least "$(($(status_field 'int(s.get("step", 0))') + 10))"

say "3. kill -9 of one VM in the running generation"
VICTIM=$(status_field '[v for v in s["vms"] if v.get("in_generation")][-1]["vm_id"]')
AGENT=$(status_field '[v for v in s["vms"] if v.get("in_generation")][-1]["agent_pid"]')
echo "killing $VICTIM (agent process group $AGENT)"
kill -9 -- "-$AGENT"
N=2 wait_until 240 "the morph after the kill" has_events resumed
manager status "$JOB" --history 3

say "4. to the end"
wait_until $((STEPS * 2 + 300)) "the job to finish" finished
manager status "$JOB" --history 3
say "varuna-manager events $JOB"
manager events "$JOB"
