"""`loraplex bench soak`, shortened to seconds: the report's structure and no unexpected failure (the
growth and the timings are the long run's to tell, not this test's); bad input is one line."""

from __future__ import annotations

import json

import pytest
from tools import require_tool

from loraplex.cli import main

PROCESSES = {"router", "local-0", "local-1", "local-2", "redis"}


@pytest.mark.slow
def test_a_short_soak_reports_every_process_and_every_kind_of_request(tiny_model, tmp_path, capsys) -> None:
    require_tool("redis-server", "apt-get install redis-server")
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--minutes", "0.3", "--warmup-minutes", "0.1", "--sample-s", "1", "--bad-every", "4",
                 "--model", str(tiny_model.base_dir.parent), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "growth: from the first sample at or after the warm-up's end" in printed
    report = json.loads(out.read_text())
    assert set(report["processes"]) == PROCESSES
    for name, p in report["processes"].items():
        assert not p["exited"], name
        assert 0 < p["warmup_end_kib"] <= p["max_kib"] and 0 < p["end_kib"] <= p["max_kib"], (name, p)
        assert isinstance(p["growth_pct"], float), (name, p)
    assert all(set(s) == PROCESSES | {"t"} for s in report["samples_kib"])
    requests = report["requests"]
    assert requests["unexpected"] == 0, requests["unexpected_by_error"]
    assert set(requests["ok_by_kind"]) == {"completion", "completion-stream", "chat", "chat-stream"}
    assert {k.split()[0] for k in requests["expected_4xx_by_kind"]} == {"unknown-adapter", "too-long", "bad-json"}
    assert requests["sent"] == requests["ok"] + requests["expected_4xx"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--minutes", "1", "--warmup-minutes", "1"], "--minutes must leave"),
    (["--bad-every", "1"], "--bad-every"),
    (["--clients", "0"], "--clients"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(flags, message, capsys) -> None:
    assert main(["bench", "soak", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
