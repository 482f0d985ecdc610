#!/usr/bin/env bash
# Record what the progress bars look like on a terminal: run a command in a detached 120x30 tmux
# session, wait for it to end (tmux wait-for, no polling) and print the pane, scrollback included.
# docs/progress.md shows the result of the default command.
#
#   scripts/record_progress.sh                 # calibrate an emulated model, then auto-config on it
#   scripts/record_progress.sh 'varuna-simulate --calibration cal.json --gpus 64 --global-batch-size 512'
set -euo pipefail
command -v tmux >/dev/null || { echo "record_progress.sh: tmux is missing; install it (apt-get install tmux)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
sock="varuna-record-$$"
default="python -m profiler.cli --model profiler.targets:emulated --model-arg fwd_s=0.002 \
--micro-batch-sizes 1,2,4 --out $work/cal.json && python -m simulator.cli --calibration $work/cal.json \
--gpus 16 --global-batch-size 256 --sweep-gpus 4,8,16 --top 3"
cmd="${1:-$default}"
cleanup() { tmux -L "$sock" kill-server 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
# The pane stays open after the command (remain-on-exit) so that it can be captured.
tmux -L "$sock" -f /dev/null new-session -d -x 120 -y 30 -c "$root" \
    "export PYTHONPATH=$(printf %q "$root")\${PYTHONPATH:+:\$PYTHONPATH}; echo '\$ '$(printf %q "$cmd"); \
$cmd; tmux -L $sock wait-for -S finished; sleep 600"
timeout 900 tmux -L "$sock" wait-for finished
tmux -L "$sock" capture-pane -p -J -S - | sed -e :a -e '/^\n*$/{$d;N;ba' -e '}'
