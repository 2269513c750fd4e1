"""Fidelity: the twin against the real engine (tiny model, 8 adapters) on the same short traces at
three loads (20, 40 and 60% of the twin's saturation rate), exactly as a user runs it: `loraplex
profile --quick` measures this machine, then `loraplex profile --check` compares. Time is the
engine thread's CPU time, so other processes on a shared CI machine disturb it little. The
longer 25/50/75% measurement is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow


def loraplex(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "loraplex.cli", *args], check=True, stdout=subprocess.DEVNULL)


def check_rows(model: list[str], profile: Path, out: Path, loads: list[float]) -> list[dict]:
    loraplex("profile", *model, "--check", str(profile), "--duration", "30",
             "--loads", ",".join(str(x) for x in loads), "--seed", "1", "--out", str(out))
    rows = json.loads(out.read_text())
    for row in rows:
        print({k: round(row[k], 3) for k in ("load", "throughput_error", "ttft_p50_error", "machine_speed",
                                             "at_speed_ttft_p50_error")})
    return rows


def missed(row: dict) -> bool:
    # The P50 TTFT error is the raw one, or, when the run's steps were slower or faster than
    # the profile says (`machine_speed`, its measured / predicted step time), the twin's at that
    # speed. A shared machine drifts by ±10-20% between profiling and checking, and at 60% load that
    # alone moves the P50 TTFT by more than 10%; both errors are printed, and the longer measurement
    # in docs/benchmarks.md reports both.
    return row["throughput_error"] > 0.05 or min(row["ttft_p50_error"], row["at_speed_ttft_p50_error"]) > 0.10


LOADS = [0.2, 0.4, 0.6]
ATTEMPTS = 3  # a burst of load on a shared machine can disturb a 30 s run: a load that missed is measured again


def test_twin_matches_the_real_engine(tiny_model, tmp_path):
    model = ["--model", str(tiny_model.base_dir), "--max-model-len", "1024"]
    loraplex("profile", *model, "--quick", "--out", str(tmp_path / "profile.json"))
    pending, misses = LOADS, []
    for attempt in range(ATTEMPTS):
        misses = [row for row in check_rows(model, tmp_path / "profile.json", tmp_path / f"check-{attempt}.json",
                                            pending) if missed(row)]
        pending = [row["load"] for row in misses]
        if not pending:
            break
    assert not misses, misses
