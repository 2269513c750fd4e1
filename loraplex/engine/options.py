"""Policy options from a flat name -> value mapping (a command line, an AdapterPool) into dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any


def options_for(options: Mapping[str, Any], *classes: type, what: str = "scheduler") -> tuple:
    """Split a policy's flat options (`scheduler_options`, `memory_options`) over its option
    dataclasses. Strings (from a command line) are converted to the type of the field's default; a
    name no class knows is an error."""
    known = {f.name: (cls, f) for cls in classes for f in fields(cls)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} option(s) {unknown}; this {what} policy takes {sorted(known) or 'none'}")
    values: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for name, value in options.items():
        cls, f = known[name]
        if isinstance(value, str) and isinstance(f.default, bool):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{what} option {name}={value!r} is not true or false")
            value = value.lower() in ("true", "1", "yes")
        elif isinstance(value, str) and f.default is not MISSING and not isinstance(f.default, str):
            kind = float if f.default is None else type(f.default)  # None-default knobs are numbers
            try:
                value = kind(value)
            except ValueError:
                raise ValueError(f"{what} option {name}={value!r} is not a {kind.__name__}") from None
        values[cls][name] = value
    return tuple(cls(**values[cls]) for cls in classes)
