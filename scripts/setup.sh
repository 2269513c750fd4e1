#!/usr/bin/env bash
# Set up a working copy: .venv with PyTorch (the CPU build unless a torch is already there),
# loraplex installed editable with every component, and redis-server for the local stack.
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

if ! command -v redis-server >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing redis-server (apt-get)" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "warning: redis-server not found; install it for 'loraplex up' and the cluster tests" >&2
  fi
fi
echo "ready: .venv/bin/loraplex --help" >&2
