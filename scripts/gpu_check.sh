#!/usr/bin/env bash
# The prepared GPU check (issue 31, docs/gpu.md): every CUDA path of the engine in one command.
#
#   scripts/gpu_check.sh --out runs/gpu_table.md       # on a GPU machine: all rows, <= 8 min on one H100
#   scripts/gpu_check.sh --device cpu --out t.md       # the same rows on CPU with tiny sizes (CI)
#   scripts/gpu_check.sh --rows 1,4 --out t.md         # rerun some rows
#
# Runs from the repository as it is (no install of the project: PYTHONPATH is the checkout). On a
# bare GPU machine whose python has no CUDA-enabled torch it installs the CUDA build of torch
# 2.13.0 (not the CPU wheel CI uses) and the packages the rows need; a torch that already sees
# the GPU is used as it is, and its version is in the table. Exit status: 0 every row passed (or
# only missed a performance goal), 1 a row failed, 2 bad usage, 3 the install failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export GPU_CHECK_COMMAND="scripts/gpu_check.sh $*"

device=cuda
prev=
for arg in "$@"; do
    case "$arg" in --device=*) device=${arg#--device=} ;; esac
    [ "$prev" = --device ] && device=$arg
    prev=$arg
done

has_cuda_torch() {
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

if [ "$device" = cuda ] && ! has_cuda_torch; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "gpu_check.sh: no NVIDIA driver here (nvidia-smi not found); use --device cpu" >&2
        exit 2
    fi
    # The CUDA 13.0 build of torch 2.13.0 from PyTorch's own index (driver 580 supports CUDA 13);
    # CUDA_INDEX overrides it (e.g. .../whl/cu128 for an older driver).
    index=${CUDA_INDEX:-https://download.pytorch.org/whl/cu130}
    echo "gpu_check.sh: $("$PY" -c 'import torch; print("torch", torch.__version__, "sees no GPU")' 2>/dev/null \
        || echo 'no torch')); installing torch==2.13.0 from $index" >&2
    "$PY" -m pip install -q "torch==2.13.0" --index-url "$index" || exit 3
    # What the rows import besides torch (transformers for the Llama row), pinned as pyproject.toml does.
    "$PY" -m pip install -q "numpy>=1.24" "transformers>=4.45" safetensors || exit 3
    has_cuda_torch || { echo "gpu_check.sh: torch still sees no GPU after the install" >&2; exit 3; }
fi

exec "$PY" -u scripts/gpu_check.py "$@"
