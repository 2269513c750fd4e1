"""Types of command-line values that every `loraplex` command shares: a port, a non-negative number,
a file or folder that must exist. argparse then refuses a bad value in one line naming the flag.
And a parser that checks another command's arguments without running it (`loraplex up`'s
--agent-arg and --router-arg)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError(text)
    return value


port.__name__ = "port (1-65535)"  # argparse names the type in its message: "invalid port (1-65535) value"


def _non_negative(kind: type) -> Callable[[str], int | float]:
    def convert(text: str) -> int | float:
        value = kind(text)
        if value < 0 or not math.isfinite(value):
            raise ValueError(text)
        return value

    convert.__name__ = f"non-negative {kind.__name__}"
    return convert


def existing_file(text: str) -> str:
    """A path flag's value that must name a readable file (checked at parse time: the flag is named)."""
    path = Path(text)
    if not path.is_file():
        why = "is a folder" if path.is_dir() else "not a regular file" if path.exists() else "no such file"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def existing_dir(text: str) -> str:
    """A path flag's value that must name a folder."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {'not a folder' if path.exists() else 'no such folder'}")
    return text


def check_values(parser: argparse.ArgumentParser) -> None:
    """Make every numeric flag of `parser` refuse what no command means: a port outside 1-65535 (any
    flag named *port), a negative, infinite or NaN number. argparse then names the flag in one line."""
    for action in parser._actions:
        if action.type not in (int, float):
            continue
        if action.dest == "port" or action.dest.endswith("_port"):
            action.type = port
        else:
            action.type = _non_negative(action.type)


class RefusingParser(argparse.ArgumentParser):
    """Raises ValueError where argparse would print the usage and exit. Made with no abbreviations and
    no -h: `--por=9000` must not slip past the flags a caller owns, nor a help page end the caller."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog=prog, allow_abbrev=False, add_help=False)

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def typed_options(options: Mapping[str, str], kinds: Mapping[str, Callable[[str], object]], what: str) -> dict:
    """The KEY=VALUE `options` named in `kinds`, each converted by its kind (the others are left out);
    ValueError naming `what` and the option when a value does not convert."""
    values: dict = {}
    for key, kind in kinds.items():
        if key in options:
            try:
                values[key] = kind(options[key])
            except ValueError:
                raise ValueError(f"{what} option {key}={options[key]!r} is not a number") from None
    return values
