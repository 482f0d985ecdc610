#!/usr/bin/env bash
# Install (first run), check the layer contracts and lint, then run the whole test suite.
# Fast subset: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
# Layers and cycles (pyproject.toml [tool.importlinter]); complexity and style (ruff).
lint-imports --no-cache
ruff check --quiet .
python3 -m pytest -q --durations=40 tests "$@"
