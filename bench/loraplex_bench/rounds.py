"""Rounds of an A/B comparison in ABBA order, for benchmarks whose runs share a noisy machine.

Round 0 runs the contenders in the order given, round 1 reversed, and so on: a machine whose load
drifts during the measurement then weighs on every contender alike, and each contender's rounds can be
pooled (`bench prefix-routing`, `bench schedulers` with `--engine-repeats`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def abba(contenders: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, contender) for `rounds` rounds, every odd round in reverse order."""
    for round_ in range(rounds):
        for contender in (contenders if round_ % 2 == 0 else list(reversed(contenders))):
            yield round_, contender
