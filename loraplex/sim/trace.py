"""The one trace format shared by the simulator and the load generator (JSONL).

Line 1 is a header: {"trace_version": 1, "workload": {...exact generator parameters...}}. Every
following line is one request: request_id, arrival_s, adapter, rank, prompt_len, output_len.
`adapter` is null for a request to the base model (rank 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACE_VERSION = 1


@dataclass(frozen=True, slots=True)  # slots: a long trace holds millions of them
class TraceRequest:
    request_id: str
    arrival_s: float
    adapter: str | None
    rank: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be non-negative")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len and output_len must be at least 1")
        if (self.adapter is None) != (self.rank == 0):
            raise ValueError(f"request {self.request_id}: rank must be 0 exactly when adapter is null")


@dataclass
class Trace:
    """Requests sorted by arrival, plus the parameters that produced them."""

    requests: list[TraceRequest]
    workload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests.sort(key=lambda r: r.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def adapters(self) -> dict[str, int]:
        """adapter name -> rank, for every adapter the trace uses."""
        return {r.adapter: r.rank for r in self.requests if r.adapter is not None}

    def head(self, max_requests: int) -> Trace:
        """The first `max_requests` requests; the arrival window ends where the next one arrives."""
        if max_requests >= len(self.requests):
            return self
        end = self.requests[max_requests].arrival_s
        return Trace(self.requests[:max_requests], dict(self.workload, max_requests=max_requests, duration_s=end))


def write_trace(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"trace_version": TRACE_VERSION, "workload": trace.workload}) + "\n")
        for request in trace.requests:
            f.write(json.dumps(asdict(request), separators=(",", ":")) + "\n")


def read_trace(path: str | Path) -> Trace:
    """Line by line (a long trace is never held as text); adapter names are interned, so a million
    requests of a thousand adapters hold a thousand names."""
    with open(path) as f:
        lines = (line for line in f if line.strip())
        first = next(lines, None)
        if first is None:
            raise ValueError(f"{path}: empty trace file")
        header = _parse(first, path, 1)
        if header.get("trace_version") != TRACE_VERSION:
            raise ValueError(f"{path}: line 1 must be a header with trace_version {TRACE_VERSION}")
        names: dict[str, str] = {}
        requests = [_request(_parse(line, path, n), path, n, names) for n, line in enumerate(lines, start=2)]
    return Trace(requests, header.get("workload", {}))


def _parse(line: str, path: str | Path, number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object")
    return value


def _request(row: dict[str, Any], path: str | Path, number: int, names: dict[str, str]) -> TraceRequest:
    adapter = row.get("adapter")
    try:
        return TraceRequest(str(row["request_id"]), float(row["arrival_s"]), names.setdefault(adapter, adapter)
                            if isinstance(adapter, str) else adapter,
                            int(row.get("rank", 0)), int(row["prompt_len"]), int(row["output_len"]))
    except KeyError as exc:
        raise ValueError(f"{path}:{number}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{number}: {exc}") from None


def requests_from(rows: Iterable[tuple[float, str | None, int, int, int]]) -> list[TraceRequest]:
    """Numbered requests from (arrival_s, adapter, rank, prompt_len, output_len) tuples."""
    return [TraceRequest(f"r{i}", round(t, 6), a, r, p, o) for i, (t, a, r, p, o) in enumerate(rows)]
