"""Pure autoscaling decision for one pool: how many servers, from the required-server estimate.

Scaling up is immediate (an overloaded pool misses its SLO now); scaling down waits until the smaller
number has sufficed for `delay` seconds, so a short lull does not drop servers that must be started
again minutes later (each start loads the base model and refetches adapters)."""

from __future__ import annotations

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
