"""Placement policies by name. A policy is a pure function of a PlacementInput (plus, for `random`,
an injected random source), so the controller and the digital twin run the same code."""

from __future__ import annotations

import random
from typing import Protocol

from loraplex.placement.baselines import ContiguousPolicy, RandomPolicy, ReplicateAllPolicy
from loraplex.placement.loraserve import DEFAULT_HYSTERESIS, LoRAServePolicy
from loraplex.placement.min_cost_flow import MinCostFlowPolicy
from loraplex.placement.snapshot import Placement, PlacementInput

POLICY_NAMES = ("loraserve", "min-cost-flow", "replicate-all", "random", "contiguous")


class PlacementPolicy(Protocol):
    name: str

    def place(self, inp: PlacementInput) -> Placement: ...


def make_policy(name: str, rng: random.Random | None = None, *,
                hysteresis: float = DEFAULT_HYSTERESIS) -> PlacementPolicy:
    """`rng` is used by `random` (required there, so runs are reproducible). `hysteresis` is
    `loraserve`'s and `min-cost-flow`'s tolerance above targetUtil within which an adapter keeps its
    previous servers (0: the paper's fresh packing every step); the baselines ignore it (`random` is
    static anyway)."""
    if name == "loraserve":
        return LoRAServePolicy(hysteresis)
    if name == "min-cost-flow":
        return MinCostFlowPolicy(hysteresis)
    if name == "replicate-all":
        return ReplicateAllPolicy()
    if name == "contiguous":
        return ContiguousPolicy()
    if name == "random":
        if rng is None:
            raise ValueError("the 'random' placement policy needs an injected random.Random")
        return RandomPolicy(rng)
    raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
