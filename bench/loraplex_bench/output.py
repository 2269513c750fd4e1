"""The JSON a twin/engine benchmark command writes: the command line, its parameters and results."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


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
