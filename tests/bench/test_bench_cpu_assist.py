"""`loraplex bench cpu-assist`: cold- vs warm-adapter TTFT with CPU assistance off and on, on the
real engine with the copy bandwidth emulated (and said so); bad input is one line."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main


def test_small_run_reports_both_passes(tmp_path, capsys) -> None:
    out = tmp_path / "assist.json"
    assert main(["bench", "cpu-assist", "--device", "cpu", "--adapters", "2", "--prompt-len", "32",
                 "--background", "1", "--emulate-h2d-gbps", "0.05", "--num-blocks", "512", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EMULATED at 0.05 GB/s" in printed and "cold/warm" in printed
    report = json.loads(out.read_text())
    off, on = report["results"]
    assert not off["cpu_assist"] and on["cpu_assist"]
    assert len(on["cold_ttft_s"]) == len(on["warm_ttft_s"]) == 2
    assert on["assisted_layers"] > 0 and on["worker_failures"] == 0 and off["assisted_layers"] == 0


@pytest.mark.parametrize("flags", [["--adapters", "0"], ["--prompt-len", "0"], ["--emulate-h2d-gbps", "-1"]])
def test_bad_input_is_one_line(flags, capsys) -> None:
    assert main(["bench", "cpu-assist", *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
