#!/usr/bin/env bash
# Install varuna the light way (torch + numpy, no extra) into a fresh venv and check that the core
# works there: no extra's package is installed, the console scripts start, the GPT example trains
# at P=2 D=2 under varuna-launch (same losses as one process: --deterministic), and varuna-manager
# names the pip install it needs in one line. Run from anywhere; the venv is deleted at the end.
#
#   bash scripts/check_light_install.sh          # PYTHON=python3.11 to pick the interpreter
#
# torch is installed first as the CPU build, pinned by its local version (torch==2.13.0+cpu), so
# the resolver can never fall back to the CUDA build and its gigabytes of nvidia-* wheels; pip
# finds it where pip is configured to look (find-links, an index; see scripts/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TORCH=${VARUNA_TORCH_SPEC:-torch==2.13.0+cpu}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/varuna-light.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH  # only the installed copy may be imported
start=$SECONDS
say() { echo "check_light_install: $*"; }
fail() { echo "check_light_install: FAILED: $*" >&2; exit 1; }

say "venv in $WORK (no system site packages)"
timeout 120 "$PY" -m venv "$WORK/venv"
BIN="$WORK/venv/bin"
timeout 600 "$BIN/python" -m pip install -q "$TORCH" \
    || fail "could not install $TORCH (the CPU wheel): point pip at it (PIP_FIND_LINKS=DIR or an index)"
# From a copy of the files git would commit: a build in the checkout would leave build/ there, and
# setuptools reuses a stale build/lib (a deleted module would still ship).
SRC="$WORK/src"
mkdir "$SRC"
if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$SRC"
else
    cp -r "$ROOT/." "$SRC"
fi
timeout 600 "$BIN/python" -m pip install -q "$SRC"
say "installed in $((SECONDS - start)) s"

# Nothing but the core's dependencies (and theirs): no extra, no CUDA.
"$BIN/python" -m pip list --format=freeze > "$WORK/pip-list.txt"
extras=$(grep -iE '^(grpcio|grpcio-tools|protobuf|azure-[a-z-]+|boto3|botocore|transformers|scipy|matplotlib|tqdm|tensorboard|nvidia-[a-z0-9-]+)==' \
    "$WORK/pip-list.txt" || true)
[ -z "$extras" ] || fail "the light install pulled in: $(echo "$extras" | tr '\n' ' ')"
grep -qE '^torch==2\.13\.0\+cpu$' "$WORK/pip-list.txt" || fail "torch is not the 2.13.0 CPU build: $(grep -i '^torch==' "$WORK/pip-list.txt")"
say "pip list: $(wc -l < "$WORK/pip-list.txt") packages, none of an extra: $(tr '\n' ' ' < "$WORK/pip-list.txt")"

cd "$WORK"  # not the checkout: `python -m` would put its varuna/ first on sys.path
where=$("$BIN/python" -c 'import varuna; print(varuna.__file__)')
case "$where" in "$WORK"/venv/*) ;; *) fail "varuna imported from $where, not the venv" ;; esac

for cmd in varuna-launch varuna-simulate varuna-profile varuna-trace varuna-checkpoint; do
    timeout 120 "$BIN/$cmd" --help > /dev/null || fail "$cmd --help failed"
done

# The manager's CLI without its extra: one line, exit 2.
set +e
hint=$(timeout 60 "$BIN/varuna-manager" status 2>&1 >/dev/null); code=$?
set -e
want="varuna-manager needs the manager extra (grpc, protobuf): pip install 'varuna[manager]'"
[ "$code" = 2 ] && [ "$hint" = "$want" ] || fail "varuna-manager status: exit $code, said: $hint"
say "varuna-manager without grpc: exit 2, $hint"

ARGS=(--steps 3 --global-batch-size 8 --micro-batch-size 2 --eval-every 0 --deterministic)
t=$SECONDS
timeout 300 "$BIN/varuna-launch" --procs 4 --pipeline-depth 2 "$SRC/examples/gpt2/train.py" "${ARGS[@]}" \
    --metrics-out "$WORK/2x2.jsonl" > "$WORK/2x2.log" 2>&1 || { tail -20 "$WORK/2x2.log" >&2; fail "GPT example at 2x2"; }
say "GPT example at P=2 D=2: $((SECONDS - t)) s"
timeout 300 "$BIN/python" "$SRC/examples/gpt2/train.py" "${ARGS[@]}" --metrics-out "$WORK/1x1.jsonl" > "$WORK/1x1.log" 2>&1 \
    || { tail -20 "$WORK/1x1.log" >&2; fail "GPT example at 1x1"; }
"$BIN/python" - "$WORK/2x2.jsonl" "$WORK/1x1.jsonl" <<'EOF'
import json, math, sys
runs = [[json.loads(line) for line in open(p)] for p in sys.argv[1:]]
two, one = ([r["loss"] for r in rows] for rows in runs)
assert len(two) == 3 and all(math.isfinite(x) for x in two), two
assert {(r["P"], r["D"]) for r in runs[0]} == {(2, 2)}, runs[0]
assert two == one, f"2x2 losses {two} differ from 1x1 {one}"
print(f"check_light_install: losses at 2x2 = 1x1, bit for bit: {', '.join(f'{x:.6f}' for x in two)}")
EOF
say "OK in $((SECONDS - start)) s"
