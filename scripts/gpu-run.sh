#!/usr/bin/env bash
# The GPU run (docs/benchmarks.md, "GPU run"): `loraplex bench gpu --all` on a lent device machine.
#
#   scripts/gpu-run.sh prepare            here, in the repository root, before asking for the machine:
#                                         the wheels the device lacks (pydantic and what it needs, at the
#                                         versions of this checkout's .venv) into .whl/ (ignored by git)
#   scripts/gpu-run.sh device [FLAGS...]  there, as the device tool's command, with .whl carried:
#                                         installs the wheels and this checkout, then runs every part
#                                         (or FLAGS, e.g. --parts 5,6) with its JSON written into $OUT
#   (a rehearsal of `device` on this machine: PYVER=3.11 ... prepare, then PATH=.venv/bin:$PATH
#    OUT=/tmp/out DEVICE=cpu scripts/gpu-run.sh device --shape tiny)
#
# On the device, python3 is its own (torch 2.11, Triton 3.6, transformers, safetensors, numpy...); of
# what the run imports only pydantic, pydantic-core, annotated-types and typing-inspection are missing
# (typing-extensions travels too: pydantic needs a newer one than the image may have). Nothing there
# can be downloaded. The run stops itself at $LIMIT seconds (default 560, under the tool's 600) with
# SIGINT, so the part in flight still writes its JSON; $OUT then holds part1..part7-*.json and
# gpu-run.log: 8 files, the most the tool brings back.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)

prepare() {
  local python=.venv/bin/python pins=()
  [[ -x $python ]] || python=python3
  for name in "${WHEELS[@]}"; do
    pins+=("$name==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
  done
  rm -rf .whl && mkdir .whl
  # the device's python3 is CPython 3.12 on x86-64 Linux (PYVER: another, for a rehearsal of `device` here)
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
  git check-ignore -q .whl || { echo "error: .whl/ is not ignored by git (.gitignore)" >&2; exit 1; }
  du -sh .whl
  echo "carry .whl: run(command='bash scripts/gpu-run.sh device', carry=['.whl'], timeout_s=600)"
}

device() {
  : "${OUT:?OUT must name the folder whose files come back}"
  local log="$OUT/gpu-run.log" site=/tmp/loraplex-site
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "error: no wheels in .whl/: run scripts/gpu-run.sh prepare here first, and carry .whl" | tee -a "$log" >&2
    exit 2
  fi
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    python3 -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
      --target "$site" .
  } 2>&1 | tee -a "$log"
  export PYTHONPATH="$site" PYTHONUNBUFFERED=1
  # the random 7B model (13.5 GB) is written once and read by every engine: in memory when it fits
  local shm_free
  shm_free=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || echo 0)
  if [[ ${shm_free:-0} -ge 20 ]]; then export TMPDIR=/dev/shm; fi
  echo "TMPDIR=${TMPDIR:-/tmp}; $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')" >>"$log"
  set +e
  timeout --signal=INT --kill-after=20 "${LIMIT:-560}" \
    python3 -m loraplex.cli bench gpu --all --device "${DEVICE:-cuda}" --out "$OUT" "$@" 2>&1 | tee -a "$log"
  local code=${PIPESTATUS[0]}
  set -e
  echo "exit status $code" | tee -a "$log"
  return "$code"
}

case "${1:-}" in
  prepare) prepare ;;
  device) shift; device "$@" ;;
  *) echo "usage: scripts/gpu-run.sh prepare | device [bench gpu flags, e.g. --parts 5,6]" >&2; exit 2 ;;
esac
