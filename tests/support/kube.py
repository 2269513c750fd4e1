"""kubectl as a user runs it, and waiting for a cluster to get somewhere, for the e2e tests."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

GROUP = "loraplex.io"


def kubectl(*args: str, namespace: str | None = None, stdin: str | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    ns = ["-n", namespace] if namespace else []
    result = subprocess.run(["kubectl", *ns, *args], input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def get_json(*args: str, namespace: str | None = None) -> dict[str, Any]:
    """`kubectl get ... -o json`, or {} when it is not there."""
    out = kubectl("get", *args, "-o", "json", namespace=namespace, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5) -> Any:
    """The first truthy value of `probe()`; fails the test with `what` when none comes in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
