"""Programs and packages a test needs: skipped where one is missing, except in CI (CI=true), where
scripts/setup.sh --dev installs them, so a missing one is a failure there, never a silent skip."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_tool(name: str, install_hint: str) -> str:
    """The path of program `name`; skips the test (fails it in CI) when it is not installed."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed ({install_hint})"
    if in_ci():
        pytest.fail(f"{message}; scripts/setup.sh --dev installs it in CI")
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, install_hint: str = "pip install -e '.[dev]'") -> ModuleType:
    """The imported module `name`; skips the test (fails it in CI) when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        message = f"{name} is not installed ({install_hint}): {exc}"
        if in_ci():
            pytest.fail(f"{message}; scripts/setup.sh --dev installs it in CI")
        pytest.skip(message, allow_module_level=True)
