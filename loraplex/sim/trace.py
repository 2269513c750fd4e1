"""The one trace format shared by the simulator and the load generator (JSONL).

Line 1 is a header: {"trace_version": 1, "workload": {...exact generator parameters...}}. Every
following line is one request: request_id, arrival_s, adapter, rank, prompt_len, output_len.
`adapter` is null for a request to the base model (rank 0).

A trace read from a file holds its requests as columns (`TraceRows`: numpy arrays, about 30 bytes
a request), so an hour of a large cluster's traffic fits in memory; a `TraceRequest` is built for
a row only while it is used.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

TRACE_VERSION = 1
_ITER_CHUNK = 4096


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


class TraceRows(Sequence[TraceRequest]):
    """Requests as columns, in arrival order: ids (bytes), arrival_s, adapter (an index into
    `names`, -1 for the base model), rank, prompt_len, output_len. Indexing builds the row's
    TraceRequest; a slice is a view."""

    def __init__(self, ids: np.ndarray, arrival_s: np.ndarray, adapter: np.ndarray, names: list[str],
                 rank: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray) -> None:
        self.ids, self.arrival_s, self.adapter, self.names = ids, arrival_s, adapter, names
        self.rank, self.prompt_len, self.output_len = rank, prompt_len, output_len

    @classmethod
    def of(cls, requests: Iterable[TraceRequest]) -> TraceRows:
        """The columns of `requests`, sorted by arrival (stable: equal arrivals keep their order)."""
        columns = _Columns()
        for request in requests:
            columns.add(request)
        return columns.rows()

    def __len__(self) -> int:
        return len(self.arrival_s)

    @overload
    def __getitem__(self, index: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, index: slice) -> TraceRows: ...

    def __getitem__(self, index: int | slice) -> TraceRequest | TraceRows:
        if isinstance(index, slice):
            return TraceRows(self.ids[index], self.arrival_s[index], self.adapter[index], self.names,
                             self.rank[index], self.prompt_len[index], self.output_len[index])
        adapter = int(self.adapter[index])
        return TraceRequest(self.ids[index].decode(), float(self.arrival_s[index]),
                            self.names[adapter] if adapter >= 0 else None, int(self.rank[index]),
                            int(self.prompt_len[index]), int(self.output_len[index]))

    def __iter__(self) -> Iterator[TraceRequest]:
        names = self.names
        for at in range(0, len(self), _ITER_CHUNK):  # a chunk of rows as Python values at a time
            rows = self[at:at + _ITER_CHUNK]
            for rid, t, a, r, p, o in zip(rows.ids.tolist(), rows.arrival_s.tolist(), rows.adapter.tolist(),
                                          rows.rank.tolist(), rows.prompt_len.tolist(), rows.output_len.tolist(),
                                          strict=True):
                yield TraceRequest(rid.decode(), t, names[a] if a >= 0 else None, r, p, o)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(
            a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside, like a list

    def adapters(self) -> dict[str, int]:
        """adapter name -> rank (its last request's) for every adapter used, in order of first use."""
        used = self.adapter >= 0
        index = self.adapter[used]
        ranks = self.rank[used]
        seen, first = np.unique(index, return_index=True)
        last = len(index) - 1 - np.unique(index[::-1], return_index=True)[1]
        order = np.argsort(first, kind="stable")
        return {self.names[a]: int(ranks[i]) for a, i in zip(seen[order].tolist(), last[order].tolist(), strict=True)}

    def tokens_by_adapter(self) -> dict[str, int]:
        """adapter name -> prompt plus output tokens of its requests."""
        used = self.adapter >= 0
        totals = np.bincount(self.adapter[used], weights=self.tokens()[used], minlength=len(self.names))
        return {self.names[a]: int(totals[a]) for a in np.unique(self.adapter[used]).tolist()}

    def tokens(self) -> np.ndarray:
        """Prompt plus output tokens of each request (int64)."""
        return self.prompt_len.astype(np.int64) + self.output_len


class _Columns:
    """Columns being filled row by row (compact arrays, not Python objects per value)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self._ids: list[bytes] = []
        self.arrival, self.adapter = array("d"), array("i")
        self.rank, self.prompt, self.output = array("i"), array("i"), array("i")
        self.names: dict[str, int] = {}

    def add(self, request: TraceRequest) -> None:
        self._ids.append(request.request_id.encode())
        if len(self._ids) >= 65536:
            self.ids.append(np.array(self._ids))
            self._ids = []
        self.arrival.append(request.arrival_s)
        name = request.adapter
        self.adapter.append(-1 if name is None else self.names.setdefault(name, len(self.names)))
        self.rank.append(request.rank)
        self.prompt.append(request.prompt_len)
        self.output.append(request.output_len)

    def rows(self) -> TraceRows:
        chunks = [*self.ids, np.array(self._ids, dtype=bytes)]
        ids = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        arrival = np.array(self.arrival, dtype=np.float64)
        in_order = bool(np.all(arrival[1:] >= arrival[:-1]))  # a written trace is: no copies then
        order = slice(None) if in_order else np.argsort(arrival, kind="stable")

        def column(values: array, dtype: type) -> np.ndarray:
            return np.asarray(values, dtype=dtype)[order]

        return TraceRows(ids[order], arrival[order], column(self.adapter, np.int32), list(self.names),
                         column(self.rank, np.int16), column(self.prompt, np.int32), column(self.output, np.int32))


@dataclass
class Trace:
    """Requests sorted by arrival, plus the parameters that produced them. Read from a file, the
    requests are columns (`TraceRows`); built in code, a list."""

    requests: list[TraceRequest] | TraceRows
    workload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.requests, list):
            self.requests.sort(key=lambda r: r.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if len(self.requests) else 0.0

    def rows(self) -> TraceRows:
        """The requests as columns (built for a list: the aggregates below read columns)."""
        return self.requests if isinstance(self.requests, TraceRows) else TraceRows.of(self.requests)

    def adapters(self) -> dict[str, int]:
        """adapter name -> rank, for every adapter the trace uses."""
        return self.rows().adapters()

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
    """Line by line into columns (a long trace is never held as text nor as one object per request)."""
    with open(path) as f:
        lines = (line for line in f if line.strip())
        first = next(lines, None)
        if first is None:
            raise ValueError(f"{path}: empty trace file")
        header = _parse(first, path, 1)
        if header.get("trace_version") != TRACE_VERSION:
            raise ValueError(f"{path}: line 1 must be a header with trace_version {TRACE_VERSION}")
        columns = _Columns()
        for n, line in enumerate(lines, start=2):
            columns.add(_request(_parse(line, path, n), path, n))
    return Trace(columns.rows(), header.get("workload", {}))


def _parse(line: str, path: str | Path, number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object")
    return value


def _request(row: dict[str, Any], path: str | Path, number: int) -> TraceRequest:
    adapter = row.get("adapter")
    try:
        return TraceRequest(str(row["request_id"]), float(row["arrival_s"]), adapter,
                            int(row.get("rank", 0)), int(row["prompt_len"]), int(row["output_len"]))
    except KeyError as exc:
        raise ValueError(f"{path}:{number}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{number}: {exc}") from None


def requests_from(rows: Iterable[tuple[float, str | None, int, int, int]]) -> list[TraceRequest]:
    """Numbered requests from (arrival_s, adapter, rank, prompt_len, output_len) tuples."""
    return [TraceRequest(f"r{i}", round(t, 6), a, r, p, o) for i, (t, a, r, p, o) in enumerate(rows)]
