"""The Azure LLM inference traces of 2023 (Splitwise): arrival times and token lengths.

The two CSVs ship gzipped inside the package (`loraplex/sim/traces`, CC-BY, attribution in its
README); every reader also takes a folder of other traces in the same format (`.csv` or `.csv.gz`).
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import numpy as np

SERVICES = ("conv", "code")
DEFAULT_TRACES_DIR = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True)
class AzureTrace:
    """One service's hour: arrival offsets (s, from the first request) and (prompt, output) lengths."""

    service: str
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1])


def trace_path(service: str, traces_dir: str | Path | None = None) -> Path:
    if service not in SERVICES:
        raise ValueError(f"unknown Azure trace {service!r}; choose from {SERVICES}")
    folder = Path(traces_dir) if traces_dir is not None else DEFAULT_TRACES_DIR
    for name in (f"AzureLLMInferenceTrace_{service}.csv", f"AzureLLMInferenceTrace_{service}.csv.gz"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder / f'AzureLLMInferenceTrace_{service}.csv'} (or .csv.gz) not found; "
                            "--traces-dir names the folder of the Azure 2023 traces")


_CACHE: dict[Path, AzureTrace] = {}


def load_azure(service: str, traces_dir: str | Path | None = None) -> AzureTrace:
    path = trace_path(service, traces_dir)
    if path not in _CACHE:
        _CACHE[path] = _read(service, path)
    return _CACHE[path]


def _read(service: str, path: Path) -> AzureTrace:
    times, prompts, outputs = [], [], []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            times.append(_seconds(row["TIMESTAMP"]))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    arrival = np.asarray(times)
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order] - arrival[order][0]
    return AzureTrace(service, arrival, np.asarray(prompts)[order], np.asarray(outputs)[order])


def _seconds(stamp: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> seconds since the epoch, read as UTC (7 fractional digits,
    which fromisoformat does not take; only differences are used)."""
    day, _, clock = stamp.partition(" ")
    hours, minutes, seconds = clock.split(":")
    return _day_seconds(day) + int(hours) * 3600 + int(minutes) * 60 + float(seconds)


@lru_cache(maxsize=64)
def _day_seconds(day: str) -> float:
    return datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=timezone.utc).timestamp()
