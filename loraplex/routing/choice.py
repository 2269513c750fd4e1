"""A routing choice: a profile by name and its options, the router's `--profile` and `--routing-option`.

An AdapterPool may name one (`spec.routing`); the routing table then carries it to every router of
the pool, and each router builds it with `build_profile`, the function that also builds the one its
flags name. So a choice is checked the same way wherever it comes from: the operator and `loraplex
up` build it once to refuse a bad one before it is published.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.routing.pipeline import Profile, configured_by_options, make_profile
from loraplex.routing.prefix import OPTIONS as PREFIX_OPTIONS
from loraplex.routing.prefix import PrefixConfig
from loraplex.routing.rank_aware import RankAwareConfig

if TYPE_CHECKING:
    from loraplex.spec.crd import AdapterPoolSpec


@dataclass(frozen=True)
class RoutingChoice:
    """A profile of `loraplex.routing.pipeline.PROFILES` and its KEY=VALUE options (those of
    `RankAwareConfig.from_options` and `PrefixConfig.from_options`)."""

    profile: str
    options: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """'rank-aware (slo_tpot_s=0.05)': for logs and errors."""
        options = ", ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.profile} ({options})" if options else self.profile


def build_profile(choice: RoutingChoice, rng: random.Random | None = None, scorers: dict[str, float] | None = None,
                  picker: str | None = None) -> Profile:
    """The profile the choice names; `scorers` and `picker` override its own (the router's flags).
    Raises ValueError on an unknown profile, option or value, and on options for a profile that reads
    none (they would do nothing, silently)."""
    prefix_options = {k: v for k, v in choice.options.items() if k in PREFIX_OPTIONS}
    rank_options = {k: v for k, v in choice.options.items() if k not in PREFIX_OPTIONS}
    rank_aware = RankAwareConfig.from_options(rank_options) if rank_options else None
    prefix = PrefixConfig.from_options(prefix_options) if prefix_options else None
    profile = make_profile(choice.profile, rng, scorers=scorers, picker=picker, rank_aware=rank_aware,
                           prefix=prefix)
    reads = configured_by_options(profile)
    if rank_options and "rank-aware" not in reads:
        raise ValueError(f"routing profile {choice.profile!r} takes no options (they set up the slo filter "
                         f"and the rank-aware scorer); got {sorted(rank_options)}")
    if prefix_options and "prefix" not in reads:
        raise ValueError(f"routing profile {choice.profile!r} takes no prefix options (they set up the prefix "
                         f"filter of prefix-aware and prefix-rank-aware); got {sorted(prefix_options)}")
    return profile


def pool_routing(spec: AdapterPoolSpec) -> RoutingChoice | None:
    """The AdapterPool's `spec.routing`; None when it names none (each router's flags decide)."""
    if spec.routing is None:
        return None
    return RoutingChoice(spec.routing.profile, dict(spec.routing.options))


def routing_error(choice: RoutingChoice | None) -> str:
    """Why the choice cannot be built ('' when it can, or when there is none)."""
    if choice is None:
        return ""
    try:
        build_profile(choice)
    except ValueError as exc:
        return str(exc)
    return ""
