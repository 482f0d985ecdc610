#!/usr/bin/env bash
# Idempotent install of everything varuna and its tests need, on a fresh Debian machine.
# --tests: also the system packages only the tests use (sshd, Chromium), as root with apt-get.
# torch is pinned to the CPU wheel first so that resolving the project never pulls the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q numpy
# all: every extra (manager, azure, aws, hf, plot, progress, tensorboard, dashboard). transformers and
# tensorboard depend on torch/numpy without a pin, so the CPU wheel installed above satisfies them
# and no other torch is pulled.
"$PY" -m pip install -q -e ".[all,test]"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else "setup.sh: torch is " + torch.__version__ + ", expected the 2.13.0 CPU wheel")'
[ "${1:-}" = --tests ] || exit 0
# OpenSSH server: the remote-launch tests start a real sshd on loopback.
if ! [ -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client >/dev/null) \
        || echo "setup.sh: could not install openssh-server; remote-launch tests will be skipped" >&2
fi
# Chromium + its driver (Debian's, version-matched): the dashboard's browser tests drive them
# with selenium (tests/dashboard_browser.py); without them those checks skip, saying why.
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
            || echo "setup.sh: could not install chromium; the dashboard's browser tests will be skipped" >&2
    else
        echo "setup.sh: not root or no apt-get: chromium not installed; the dashboard's browser tests will be skipped" >&2
    fi
fi
# Slurm (slurmctld, slurmd, srun, sbatch) and munge: tests/test_slurm.py starts a one-host cluster
# of its own (tests/slurm_cluster.py: its own key, config and state in a temporary directory; the
# packages' system services are not used); without them those tests skip, saying why.
if ! { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
            || echo "setup.sh: could not install slurm-wlm/munge; the Slurm tests will be skipped" >&2
    else
        echo "setup.sh: not root or no apt-get: slurm-wlm not installed; the Slurm tests will be skipped" >&2
    fi
fi
