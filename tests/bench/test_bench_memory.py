"""`loraplex bench memory`: the memory policies on multi-turn sessions, in the twin and on the real
engine, one table per side, ratios against lru-static, a JSON report; bad input is one line."""

from __future__ import annotations

import inspect
import json

import pytest

from loraplex.cli import main

TINY_TWIN = ["bench", "memory", "--side", "twin", "--sessions", "8", "--adapters", "6", "--rate", "2",
             "--think", "1", "--length-scale", "0.5"]


def test_twin_side_prints_a_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "memory.json"
    assert main([*TINY_TWIN, "--no-prefix-cache", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT mean ms" in printed and "unified mean TTFT =" in printed
    report = json.loads(out.read_text())
    [twin] = report["sides"]
    assert twin["side"] == "twin" and twin["settings"]["profile"] == "whatif-h100-llama8b"
    rows = {r["variant"]: r for r in twin["results"]}
    assert set(rows) == {"unified", "unified-no-prefix", "lru-static", "no-cache"}
    assert rows["lru-static"]["ttft_ratio"] == 1.0
    assert rows["unified-no-prefix"]["summary"]["prefix_hit_rate"] == 0.0
    assert rows["unified"]["summary"]["invalid_kv_pages"] == 0
    assert all(r["summary"]["finished"] == r["summary"]["turns"] > 0 for r in rows.values())
    assert report["goal_ratio"] == 0.35 and report["parameters"]["sessions"] == 8


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-lora-rank", "64"], "--max-lora-rank 64 is below the largest adapter rank 128"),
    (["--rate", "0"], "rate"),
    (["--ranks", "8,x"], "--ranks"),
    (["--profile", "no-such-profile"], "not found"),
    (["--max-loras", "200"], "lru-static"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(flags, message, capsys) -> None:
    assert main([*TINY_TWIN, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def _engine_pieces_missing() -> str | None:
    """The real-engine side needs the engine's memory work (the executor's emulated copies)."""
    try:
        from loraplex_agent.runtime.executor import TorchExecutor
    except ImportError as exc:
        return f"the torch executor does not import ({exc})"
    if "emulate_h2d_gbps" not in inspect.signature(TorchExecutor).parameters:
        return "TorchExecutor has no emulate_h2d_gbps yet"
    return None


def test_engine_side_smoke(tmp_path, capsys) -> None:
    missing = _engine_pieces_missing()
    if missing:
        pytest.skip(f"engine side not testable: {missing}")
    out = tmp_path / "engine.json"
    assert main(["bench", "memory", "--side", "engine", "--adapters", "3", "--engine-sessions", "2",
                 "--engine-rate", "4", "--think", "0.1", "--turns", "2", "--engine-length-scale", "0.05",
                 "--max-loras", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EMULATED host->device bandwidth" in printed
    [engine] = json.loads(out.read_text())["sides"]
    assert engine["side"] == "engine" and engine["settings"]["emulated_h2d_gbps"] > 0
    rows = {r["variant"]: r["summary"] for r in engine["results"]}
    assert set(rows) == {"unified", "lru-static", "no-cache"}
    assert all(s["finished"] == s["turns"] > 0 for s in rows.values())
