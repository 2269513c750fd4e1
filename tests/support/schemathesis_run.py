"""Running the Schemathesis CLI against a live server, bounded for CI: the schema's examples,
its boundary cases (coverage phase) and a few generated requests per operation (fuzzing phase), valid
and invalid, with only the "no 5xx" check. The seed is fixed, so a CI failure reproduces locally with
the command it prints. LORAPLEX_FUZZ_EXAMPLES and LORAPLEX_FUZZ_SEED run a longer or another search."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tools import require_module

MAX_EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "30"))  # generated requests per operation
SEED = int(os.environ.get("LORAPLEX_FUZZ_SEED", "20260101"))
SUPPORT = Path(__file__).resolve().parent


def schemathesis_command(schema_url: str, base_url: str, headers: dict[str, str] | None = None,
                         max_examples: int = MAX_EXAMPLES) -> list[str]:
    """The CLI command; `headers` go with every request."""
    require_module("schemathesis")
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    command = [cli, "run", schema_url, "--url", base_url, "--checks", "not_a_server_error",
               "--phases", "examples,coverage,fuzzing", "--max-examples", str(max_examples), "--seed", str(SEED),
               "--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all", "--warnings", "off",
               "--output-truncate", "false"]
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    return command


def run_schemathesis(command: list[str], workdir: Path, models: tuple[str, ...] = (), timeout_s: float = 300) -> str:
    """Run the CLI in `workdir` (its Hypothesis database and reports stay there), generated bodies
    naming one of `models` often (schemathesis_hooks.py); fail with its report when any request got
    a 5xx or the server did not answer."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=timeout_s,
                          env={**_clean_env(), "NO_COLOR": "1", "COLUMNS": "160", "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                               "PYTHONPATH": str(SUPPORT), "LORAPLEX_FUZZ_MODELS": ",".join(models)})
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"schemathesis found problems (exit {done.returncode}):\n{output[-20000:]}", pytrace=False)
    return output


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SCHEMATHESIS_")}
