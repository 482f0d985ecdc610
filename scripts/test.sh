#!/usr/bin/env bash
# Install (first run) and run the whole test suite. Fast subset: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q tests "$@"
