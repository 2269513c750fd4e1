"""The fused CPU LoRA delta: a C++ extension built at first use, or None when it cannot be built.

`load()` compiles `cpu_lora.cpp` (shipped beside this module as package data) with `torch.utils.cpp_extension.load_inline` (ninja, the
host C++ compiler, `-O3 -march=native`, OpenMP through `at::parallel_for`, so it follows
`torch.set_num_threads`). The module name carries a hash of the source, the flags, the torch version
and this CPU's model and flags, so a changed source, another torch or another machine sharing the
home directory gets its own build. Builds live under `TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions`); a later process imports the built library directly, without ninja.

Every failure (no compiler, no ninja, a compile error, an import error) is logged once and makes
`load()` return None; callers then use the torch reference. `unavailable_reason()` says why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.cpp").read_text()

CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 600  # a build lock older than this was left by a killed build

_state: dict[str, ModuleType | str | None] = {"module": None, "reason": None}


def load() -> ModuleType | None:
    """The built extension, building it on the first call; None (logged once) if that fails."""
    if _state["module"] is None and _state["reason"] is None:
        try:
            _state["module"] = _build_or_import()
        except Exception as error:  # noqa: BLE001 - any build failure means: use the reference
            _state["reason"] = f"{type(error).__name__}: {error}".strip()[:2000]
            log.warning("fused CPU LoRA kernel unavailable, using the torch reference: %s", _state["reason"])
    module = _state["module"]
    return module if isinstance(module, ModuleType) else None


def unavailable_reason() -> str | None:
    """Why `load()` returned None (after it was called), else None."""
    reason = _state["reason"]
    return reason if isinstance(reason, str) else None


def toolchain_missing() -> str | None:
    """What is missing to build the extension here (a C++ compiler or ninja), else None."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    if _ninja_dir() is None:
        return "no ninja (pip install ninja)"
    return None


BUILDING = ("building the fused CPU LoRA kernel: C++, once per machine and torch version, about a minute on "
            "two cores")

def extension_name() -> str:
    fingerprint = "\n".join([SOURCE, *CFLAGS, *LDFLAGS, torch.__version__, sys.version, _cpu_fingerprint()])
    return "loraplex_lora_cpu_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def _build_or_import() -> ModuleType:
    missing = toolchain_missing()
    if missing:
        raise RuntimeError(missing)
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    name = extension_name()
    build_dir = Path(_get_build_directory(name, verbose=False))
    library, lock = build_dir / f"{name}.so", build_dir / "lock"
    _remove_stale_lock(lock)
    if library.exists() and not lock.exists():  # built, and no build of it under way
        return _import_library(name, library)
    started = time.perf_counter()
    log.warning("%s (in %s)", BUILDING, build_dir)  # `loraplex up` relays this line from the agents' logs
    with _ninja_on_path():
        module = load_inline(name, cpp_sources=[SOURCE], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                             build_directory=str(build_dir))
    log.info("built the fused CPU LoRA kernel in %.1f s (%s)", time.perf_counter() - started, build_dir)
    return module


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on a build lock; one left by a killed process would hang every start."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


def _ninja_dir() -> str | None:
    """Where the ninja executable is: PATH, else the `ninja` Python package (a venv not on PATH)."""
    found = shutil.which("ninja")
    if found:
        return str(Path(found).parent)
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR


@contextmanager
def _ninja_on_path():
    """torch runs `ninja` from PATH; add the package's directory for the build only."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([_ninja_dir() or "", old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _cpu_fingerprint() -> str:
    """The CPU model and flags (what -march=native compiled for), or the platform where unknown."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
