"""What a benchmark command writes besides its table: the JSON (the command line, its parameters and
results), the --plots flag every sweeping command shares, and the progress display on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loraplex.cli import Run


def write_bench_json(path: Path, command: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """`command` is e.g. "bench memory"; `results` are the command's own fields (dataclasses as dicts)."""
    words = command.split()
    argv = sys.argv[1:]
    line = ("loraplex " + " ".join(words + argv[len(words):]) if argv[:len(words)] == words
            else " ".join(sys.argv))
    parameters = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": line, "parameters": parameters, **results}, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def add_plots_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--plots DIR: a PNG per result series (`what` says which), drawn by `report.plot_series`."""
    p.add_argument("--plots", default=None, metavar="DIR",
                   help=f"write a PNG per result series here: {what} (needs matplotlib)")


_stages: list[Callable[[str], None]] = []  # the spinner's stage setter while `with_progress` shows one


def stage(line: str) -> None:
    """A long benchmark's next stage: the spinner's text on a terminal (see `with_progress`), else the
    line on stdout, as a log."""
    if _stages:
        _stages[-1](line)
    else:
        print(line, flush=True)


def with_progress(what: str, run: Run) -> Run:
    """`run` with `sim run`'s spinner on stderr (loraplex.sim.console.progress) naming its `stage`s and the
    elapsed time; none where stderr is not a terminal or with --quiet."""
    def run_showing(args: argparse.Namespace) -> int:
        if getattr(args, "quiet", False) or not sys.stderr.isatty():
            return run(args)
        with _spinner(what):
            return run(args)

    return run_showing


@contextmanager
def _spinner(what: str) -> Iterator[None]:
    from loraplex.sim.console import progress

    with progress(what) as say:
        _stages.append(say)
        try:
            yield
        finally:
            _stages.pop()
