"""kubectl as a user runs it, for the e2e tests."""

from __future__ import annotations

import json
import subprocess
from typing import Any

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
