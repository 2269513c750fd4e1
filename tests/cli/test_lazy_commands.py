"""`loraplex` loads only the component a command line names: `loraplex up` (and its check of --agent-arg
and --router-arg, the router's values included) imports no benchmark module; `loraplex --version` says
the installed version."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from loraplex.cli import build_registry

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def test_version_is_one_line() -> None:
    result = subprocess.run([LORAPLEX, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == f"loraplex {version('loraplex')}\n"


def test_up_imports_no_benchmark_module() -> None:
    probe = ("import sys\nfrom loraplex.cli import main\n"
             "main(['up', '--agent-arg=--num-blocks=64', '--router-arg=--max-attempts=0'])\n"
             "print(sorted(m for m in sys.modules if m.startswith('loraplex_bench')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]" and "--max-attempts must be at least 1" in result.stderr


def test_a_components_registry_holds_its_commands_and_the_cores() -> None:
    commands = build_registry("agent").summary()
    assert "agent" in commands and "sim run" in commands and "bench" not in commands
    assert "bench engine" in build_registry().summary()
