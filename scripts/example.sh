#!/usr/bin/env bash
# Install (first run) and train the GPT example on an embedded local cluster:
# 2 pipeline stages x 2 data-parallel replicas = 4 processes on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs/gpt2
varuna-launch --procs 4 --pipeline-depth 2 examples/gpt2/train.py \
    --steps "${STEPS:-40}" --global-batch-size 32 --micro-batch-size 4 \
    --metrics-out runs/gpt2/metrics.jsonl "$@"
