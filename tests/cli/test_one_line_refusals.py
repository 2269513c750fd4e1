"""Bad values of the engine settings, the twin's flags and a workload spec are refused in one line with a
non-zero exit: a setting's flag refuses what the AdapterPool's field refuses (its declared bounds), a
path that is not a regular file says so, and pydantic's error block is one line naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def refused(*args: str, cwd: Path) -> str:
    result = subprocess.run([LORAPLEX, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "fragment"), [
    (["agent", "--max-lora-rank", "0"], "argument --max-lora-rank: invalid int (>= 1, <= 512) value: '0'"),
    (["agent", "--max-lora-rank", "513"], "argument --max-lora-rank"),
    (["agent", "--kv-cache-memory", "nan"], "argument --kv-cache-memory"),
    (["sim", "run", "--trace", "TRACE", "--max-loras", "0"], "argument --max-loras: invalid int (>= 1) value"),
    (["sim", "run", "--trace", "/dev/null"], "argument --trace: /dev/null: not a regular file"),
])
def test_a_bad_flag_is_one_line(tmp_path: Path, args: list[str], fragment: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    assert fragment in refused(*[str(trace) if a == "TRACE" else a for a in args], cwd=tmp_path)


def test_a_bad_workload_spec_is_one_line_naming_the_field(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("duration_s: -5\nrps: fast\n")
    line = refused("workload", "generate", "--spec", str(spec), "--out", str(tmp_path / "t.jsonl"), cwd=tmp_path)
    assert line == "error: invalid workload: duration_s: Input should be greater than 0 (and 1 more)"
