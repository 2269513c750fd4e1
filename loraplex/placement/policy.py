"""Placement policies by name. A policy is a pure function of a PlacementInput (plus, for `random`,
an injected random source), so the controller and the digital twin run the same code."""

from __future__ import annotations

import random
from typing import Protocol

from loraplex.placement.baselines import ContiguousPolicy, RandomPolicy, ReplicateAllPolicy
from loraplex.placement.loraserve import LoRAServePolicy
from loraplex.placement.snapshot import Placement, PlacementInput

POLICY_NAMES = ("loraserve", "replicate-all", "random", "contiguous")


class PlacementPolicy(Protocol):
    name: str

    def place(self, inp: PlacementInput) -> Placement: ...


def make_policy(name: str, rng: random.Random | None = None) -> PlacementPolicy:
    """`rng` is used by `random` (required there, so runs are reproducible)."""
    if name == "loraserve":
        return LoRAServePolicy()
    if name == "replicate-all":
        return ReplicateAllPolicy()
    if name == "contiguous":
        return ContiguousPolicy()
    if name == "random":
        if rng is None:
            raise ValueError("the 'random' placement policy needs an injected random.Random")
        return RandomPolicy(rng)
    raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
