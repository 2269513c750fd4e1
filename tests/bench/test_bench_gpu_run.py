"""`loraplex bench gpu --all`, the GPU run, rehearsed on the CPU (`--shape tiny`, the Triton kernels in
Triton's interpreter): every part runs and writes its JSON; a failing or hanging part is recorded in
its own JSON and the run goes on; bad input is one line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from triton_interpreter import patch_interpreter_index

from loraplex.cli import main
from loraplex.latency.profile import Profile

PART_FILES = ["part1-greedy.json", "part2-kernels.json", "part3-decode.json", "part4-mixed-ranks.json",
              "part5-cold-warm.json", "part6-policies.json", "part7-twin.json"]


@pytest.mark.slow
def test_the_rehearsal_runs_every_part_and_writes_its_json(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as tests/conftest.py does: before the kernels import triton
    patch_interpreter_index()
    out = tmp_path / "run"
    code = main(["bench", "gpu", "--all", "--device", "cpu", "--shape", "tiny", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == PART_FILES
    parts = {name: json.loads((out / name).read_text()) for name in PART_FILES}
    assert {name: (p["status"], p["error"]) for name, p in parts.items()} == {name: ("ok", None) for name in PART_FILES}
    assert code == 0
    assert parts["part1-greedy.json"]["results"]["identical"]
    assert parts["part1-greedy.json"]["results"]["max_abs_logit_diff"] == 0.0  # the CPU against itself
    assert parts["part1-greedy.json"]["results"]["adapter_ranks"] == [8, 16, 32, 64, 128, 8, 16, 32]
    kernels = parts["part2-kernels.json"]["results"]["worst_rel_error"]
    assert set(kernels) == {"attention-decode", "attention-prefill", "lora-decode", "lora-prefill"}
    assert max(kernels.values()) < 1e-3  # float32 on the CPU: the Triton kernels agree with the references
    assert {(d["batch"], d["adapters"]) for d in parts["part3-decode.json"]["results"]["decode"]} >= {(1, 0), (4, 4)}
    assert [p["cpu_assist"] for p in parts["part5-cold-warm.json"]["results"]["passes"]] == [False, True]
    assert parts["part5-cold-warm.json"]["results"]["engine_copies_from"] == "pageable"  # CPU torch cannot pin
    policies = parts["part6-policies.json"]["results"]
    assert [r["variant"] for r in policies["memory"]["results"]] == ["unified", "lru-static"]
    assert {r["scheduler"] for r in policies["schedulers"]["runs"]} == {"chameleon", "fifo"}
    twin = parts["part7-twin.json"]["results"]
    Profile.model_validate(twin["profile"])  # the shipped profile format
    assert set(twin["steps_by_part"]) == {"1", "2", "3", "4", "5", "6"} and twin["steps_by_part"]["3"] > 0
    assert len(twin["decode_error"]) == len(parts["part3-decode.json"]["results"]["decode"])
    assert [r["run"] for r in twin["memory_error"]] == ["unified", "lru-static"]
    assert {r["run"] for r in twin["scheduler_error"]} == {"chameleon", "fifo"}


def _state(tmp_path: Path):
    from loraplex_bench.gpu_run import GpuRun
    from loraplex_bench.gpu_sizes import SIZES

    args = argparse.Namespace(seed=0, all=True, parts=None, out=str(tmp_path), quick=False, num_blocks=None, plots=None)
    return GpuRun(args, torch.device("cpu"), "tiny", SIZES["tiny"], tmp_path, tmp_path)


def test_a_failing_part_is_recorded_and_the_next_part_runs(tmp_path) -> None:
    from loraplex_bench.gpu_run import Part, run_part

    def fails(run, out) -> None:
        out["measured"] = [1.0]  # what ran before the failure is kept
        raise RuntimeError("the kernel launch failed")

    def works(run, out) -> None:
        out["measured"] = [2.0]

    state = _state(tmp_path)
    statuses = [run_part(state, Part(8, "fails", 10, fails)), run_part(state, Part(9, "works", 10, works))]
    assert statuses == ["failed", "ok"]
    failed = json.loads((tmp_path / "part8-fails.json").read_text())
    assert failed["error"] == "RuntimeError: the kernel launch failed" and failed["results"]["measured"] == [1.0]
    assert "Traceback" in failed["results"]["traceback"]
    assert json.loads((tmp_path / "part9-works.json").read_text())["status"] == "ok"


def test_a_part_past_its_budget_is_stopped(tmp_path) -> None:
    from loraplex_bench.gpu_run import HARD_FACTOR, Part, run_part

    def hangs(run, out) -> None:
        out["started"] = True
        time.sleep(30)

    began = time.perf_counter()
    assert run_part(_state(tmp_path), Part(8, "hangs", 0.2, hangs)) == "over budget"
    assert time.perf_counter() - began < 10
    report = json.loads((tmp_path / "part8-hangs.json").read_text())
    assert report["error"] == f"stopped at {HARD_FACTOR} x its budget of 0.2 s"
    assert report["results"] == {"started": True}


@pytest.mark.parametrize(("argv", "message"), [
    (["--all"], "give the folder with --out DIR"),
    (["--parts", "3,9", "--out", "x"], "--parts must be comma-separated part numbers 1-7"),
    (["--all", "--quick", "--out", "x"], "--quick, --num-blocks and --plots are the single report's"),
])
def test_bad_input_is_one_line(argv, message, capsys) -> None:
    assert main(["bench", "gpu", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-run.sh"


@pytest.mark.parametrize(("argv", "env", "message"), [
    ([], {}, "usage: scripts/gpu-run.sh prepare | device"),
    (["device"], {}, "OUT must name the folder whose files come back"),
])
def test_the_device_script_refuses_in_one_line(argv, env, message) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "OUT"} | env
    done = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, env=environ, timeout=60)
    assert done.returncode != 0 and message in done.stderr and done.stderr.count("\n") == 1
