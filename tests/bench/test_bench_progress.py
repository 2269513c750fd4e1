"""The long benchmarks' progress display (loraplex_bench.output.with_progress): `sim run`'s spinner on
stderr naming the stages where stderr is a terminal; the stage lines on stdout, as before, where not."""

from __future__ import annotations

import argparse
import sys

import pytest
from loraplex_bench.output import stage, with_progress


def _run(args: argparse.Namespace) -> int:
    stage("probing 2 req/s ...")
    print("the table")
    return 0


def test_without_a_terminal_the_stages_are_lines_on_stdout(capsys: pytest.CaptureFixture) -> None:
    assert with_progress("bench t", _run)(argparse.Namespace()) == 0
    captured = capsys.readouterr()
    assert captured.out == "probing 2 req/s ...\nthe table\n" and captured.err == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_on_a_terminal_a_spinner_shows_them_on_stderr_unless_quiet(capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    quiet: bool) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert with_progress("bench t", _run)(argparse.Namespace(quiet=quiet)) == 0
    captured = capsys.readouterr()
    assert "the table" in captured.out and ("probing" in captured.out) == quiet
    assert ("bench t: done in" in captured.err) != quiet
