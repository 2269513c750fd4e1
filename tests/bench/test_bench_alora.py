"""`loraplex bench alora`: checker pipelines as activated LoRA vs standard LoRA; the twin side gives a
table and JSON, an aLoRA checker finds its conversation cached; bad input is one line."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main


def test_twin_side_reports_alora_checkers_reusing_the_conversation(tmp_path, capsys) -> None:
    out = tmp_path / "alora.json"
    argv = ["bench", "alora", "--side", "twin", "--ks", "2", "--sessions", "2", "--turns", "2",
            "--system-tokens", "200", "--json", str(out)]
    assert main(argv) == 0
    assert "| twin | 2 | alora |" in capsys.readouterr().out
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    alora, lora = rows["alora"], rows["lora"]
    assert alora["pipelines"] == lora["pipelines"] == 4
    assert alora["checker_cached"] > 0.9 * alora["checker_prompt"]  # every checker on the base's KV
    assert lora["checker_cached"] < 0.6 * lora["checker_prompt"]  # only its own earlier turn
    assert alora["checker_ttft_s"] < lora["checker_ttft_s"]


@pytest.mark.parametrize(("flags", "message"), [(["--ks", "7"], "--ks takes 1 to 6"),
                                                 (["--ks", "x"], "comma-separated integers"),
                                                 (["--sessions", "0"], "must be >= 1")])
def test_bad_arguments_are_one_line(flags, message, capsys) -> None:
    assert main(["bench", "alora", "--side", "twin", *flags]) != 0
    assert message in capsys.readouterr().err
