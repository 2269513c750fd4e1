"""Pure autoscaling decision for one pool: how many servers, from the required-server estimate.

Scaling up is immediate (an overloaded pool misses its SLO now); scaling down waits until the smaller
number has sufficed for `delay` seconds, so a short lull does not drop servers that must be started
again minutes later (each start loads the base model and refetches adapters)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    below_since: float | None  # when the estimate first fell below `replicas` (None: it has not)
    reason: str = ""           # "ScaleUp", "ScaleDown", "Bounds" when replicas changed, else ""


def decide_replicas(current: int, required: int | None, min_replicas: int, max_replicas: int,
                    below_since: float | None, now: float, delay: float) -> ScaleDecision:
    """`current` is the spec's replica count; `required` is None while no estimate exists yet."""
    if min_replicas > max_replicas:
        raise ValueError(f"min_replicas {min_replicas} exceeds max_replicas {max_replicas}")
    bounded = min(max(current, min_replicas), max_replicas)
    if required is None:
        return ScaleDecision(bounded, None, "Bounds" if bounded != current else "")
    target = min(max(required, min_replicas), max_replicas)
    if target > bounded:
        return ScaleDecision(target, None, "ScaleUp")
    if target == bounded:
        return ScaleDecision(bounded, None, "Bounds" if bounded != current else "")
    if below_since is None:
        return ScaleDecision(bounded, now, "Bounds" if bounded != current else "")
    if now - below_since >= delay:
        return ScaleDecision(target, None, "ScaleDown")
    return ScaleDecision(bounded, below_since, "Bounds" if bounded != current else "")


def short_of_capacity(overloaded: Sequence[str], max_server_load: float | None) -> bool:
    """The placement overloaded servers (the ones able to hold some rank are full) and the busiest
    server is forecast above what one server sustains under the SLO. Overloaded servers below 1.0
    are an imbalance that more servers of the same kind would not cure."""
    return bool(overloaded) and (max_server_load or 0.0) > 1.0 + 1e-6


def with_shortfall(required: int | None, short: bool, healthy_servers: int) -> int | None:
    """The placement's estimate, raised to one server more than the healthy ones while the pool is
    short of capacity: Σ load may fit in the servers while the ranks do not. Counting healthy
    servers, not replicas, asks for no more while new ones still start."""
    if not short:
        return required
    return max(required or 0, healthy_servers + 1)
