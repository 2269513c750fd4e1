"""A local stack's logs, kept for a failure. Its children's (agents, vLLM servers, router, Redis) are
in its workdir's logs folder already; `kept_logs` adds the stack's own (manifests applied, placements
published, adapters left unplaced), which it logs in the test's process, and copies them all into
LORAPLEX_E2E_LOGS (if set) when a test failed, as the Kubernetes tests keep their pods' logs."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

STACK_LOG = "stack.log"  # the stack's own log, in its workdir


@contextmanager
def kept_logs(workdir: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """Around a stack's whole life (`running_stack` inside the block): its own log goes to
    `workdir/stack.log`; afterwards, when a test failed meanwhile, `stack.log` and the logs folder are
    copied to LORAPLEX_E2E_LOGS/<workdir's name>."""
    workdir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(workdir / STACK_LOG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("loraplex")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    failed = request.session.testsfailed
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
        folder = os.environ.get("LORAPLEX_E2E_LOGS")
        if folder and request.session.testsfailed > failed:
            kept = Path(folder) / workdir.name
            shutil.copytree(workdir / "logs", kept / "logs", symlinks=True, dirs_exist_ok=True)
            shutil.copy2(workdir / STACK_LOG, kept / STACK_LOG)
