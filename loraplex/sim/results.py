"""Results files (JSONL): a header with the workload parameters and run facts, then one request per line.

`loraplex bench serve` and `loraplex sim run --out` write the same format, so `bench report` reads both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from loraplex.sim.metrics import RequestResult

RESULTS_VERSION = 1
_FIELDS = {f.name for f in fields(RequestResult)}


def write_results(path: str | Path, workload: dict[str, Any], results: Iterable[RequestResult],
                  info: dict[str, Any] | None = None) -> None:
    with open(path, "w") as f:
        header = {"results_version": RESULTS_VERSION, "workload": workload, **(info or {})}
        f.write(json.dumps(header) + "\n")
        for result in results:
            f.write(json.dumps(result.to_json(), separators=(",", ":")) + "\n")


def read_results(path: str | Path) -> tuple[dict[str, Any], list[RequestResult]]:
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty results file")
    header = json.loads(lines[0])
    if header.get("results_version") != RESULTS_VERSION:
        raise ValueError(f"{path}: line 1 must be a header with results_version {RESULTS_VERSION}")
    results = []
    for number, line in enumerate(lines[1:], start=2):
        row = json.loads(line)
        if not set(row) <= _FIELDS:
            raise ValueError(f"{path}:{number}: unknown fields {sorted(set(row) - _FIELDS)}")
        results.append(RequestResult(**row))
    return header, results
