"""The router's policy: filters -> weighted scorers -> one picker, over a snapshot of candidates.

Pure and torch-free, with an injected random source, so the router and the simulator run the very
same code. The shape follows the Gateway API Inference Extension's endpoint picker: filters drop
servers, each scorer gives every survivor a score in [0, 1], the scores are summed with weights
that are data, and a picker chooses one server from the weighted scores.

The default profile is LoRAServe's: keep healthy servers the table assigns the adapter to, score
each by its φ and pick at random in proportion to the score, so P(server) = φ renormalised over the
healthy servers (paper §3.8). `rank-aware` is Toppings' Algorithm 1 over the servers' live batches
(`loraplex.routing.rank_aware`); `least-loaded` takes the shortest queue. `prefix-aware` and
`prefix-rank-aware` first keep the servers that hold the longest cached prefix of the request under a
load ceiling (`loraplex.routing.prefix`), then pick as `loraserve` and `rank-aware` do.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.routing.prefix import PrefixConfig, chunk_tokens
from loraplex.routing.rank_aware import RankAwareConfig, RankAwareScorer, SloFilter
from loraplex.routing.records import ServerBatch


class Residency(enum.IntEnum):
    """Where a server holds an adapter; higher is closer to the GPU."""

    NONE = 0
    HOST = 1
    GPU = 2


@dataclass(frozen=True)
class Candidate:
    """One server as the policy sees it for one request."""

    server_id: str
    healthy: bool = True
    phi: float = 0.0                    # the table's φ(adapter, server); 0 when not assigned
    residency: Residency = Residency.NONE
    queue_depth: int = 0                # running + waiting requests (best knowledge)
    max_rank: int | None = None         # the largest rank the server accepts; None: no limit
    batch: ServerBatch | None = None    # its live batch by rank; None: not reported or stale
    prefix_blocks: int = 0              # leading prefix blocks of the request it is known to hold


@dataclass(frozen=True)
class RouteRequest:
    """What the policy needs to know about a request: the adapter (None for the base model), its rank
    and, when known, its prompt length and how many prefix blocks (`loraplex.routing.prefix`) it has."""

    adapter: str | None
    rank: int | None = None
    prompt_tokens: int | None = None
    prefix_blocks: int = 0
    alora: bool = False  # an activated LoRA: its prefix is the base model's conversation (`loraplex.spec.alora`)


class Filter(Protocol):
    """Drops candidates that must not serve the request. May return an empty list. A filter may also
    say `reads_load` / `reads_batch` (default False), as scorers do."""

    name: str

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1], 1 being best. Returns one score per candidate, in order.
    `reads_load`: whether the scores depend on live server state (queue depth, residency, batch).
    A scorer may also say `reads_batch` (default False): it needs `Candidate.batch`."""

    name: str
    reads_load: bool

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one candidate from weighted scores (same order as the candidates)."""

    name: str

    def pick(self, candidates: list[Candidate], scores: list[float], rng: random.Random) -> Candidate: ...


class NoCandidateError(Exception):
    """No server can take the request; `reason` names the filter that emptied the list."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"no server can take the request ({reason})")
        self.reason = reason


# ---- filters --------------------------------------------------------------------------------


class HealthyFilter:
    name = "healthy"

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return [c for c in candidates if c.healthy]


class RankFilter:
    """Keeps servers whose maximum rank admits the adapter's rank (unknown rank or limit: keep)."""

    name = "rank"

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if request.rank is None:
            return candidates
        return [c for c in candidates if c.max_rank is None or c.max_rank >= request.rank]


class AssignedFilter:
    """Keeps the servers the table assigns the adapter to (φ > 0).

    Fallbacks for the cases the paper leaves open (notes §3.8): no assigned server left, then the
    servers that physically hold the adapter; none of those either (a new adapter the placement has
    not seen yet), then every candidate, because any agent can fetch the adapter on a miss.
    Requests for the base model keep every candidate.
    """

    name = "assigned"

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if request.adapter is None:
            return candidates
        assigned = [c for c in candidates if c.phi > 0]
        if assigned:
            return assigned
        holding = [c for c in candidates if c.residency > Residency.NONE]
        return holding or candidates


@dataclass
class PrefixFilter:
    """Keeps the servers under the load ceiling with the longest prefix match (`loraplex.routing.prefix`).
    Every candidate when no server matches: the scorers decide as they would without prefixes."""

    config: PrefixConfig = field(default_factory=PrefixConfig)
    name = "prefix"
    reads_load = True

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        floor = self.config.min_match
        if request.prefix_blocks < floor or max(c.prefix_blocks for c in candidates) < floor:
            return candidates
        least = min(c.queue_depth for c in candidates)
        ceiling = least * self.config.load_factor + self.config.load_slack
        light = [c for c in candidates if c.queue_depth <= ceiling + self.alora_slack(request, c)]
        best = max(c.prefix_blocks for c in light)
        if best < floor:
            return light
        return [c for c in light if c.prefix_blocks == best]

    def alora_slack(self, request: RouteRequest, candidate: Candidate) -> int:
        """The extra load an activated LoRA's request may queue behind on a server: `alora_slack`, and one
        request more per `alora_slack_tokens` of its prompt cached there, the prefill that server saves it
        (a checker sent elsewhere recomputes the whole conversation). Ordinary requests: none."""
        if not request.alora:
            return 0
        per = self.config.alora_slack_tokens
        saved = candidate.prefix_blocks * chunk_tokens(self.config.chunk_chars)
        return self.config.alora_slack + (saved // per if per else 0)


# ---- scorers --------------------------------------------------------------------------------


class PhiScorer:
    """φ itself: with the weighted-random picker this is LoRAServe's routing."""

    name = "phi"
    reads_load = False

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return clamp_unit([c.phi for c in candidates])


class QueueScorer:
    """Shorter queues score higher: min-max normalised, 1.0 for all when the queues are equal."""

    name = "queue"
    reads_load = True

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        depths = [c.queue_depth for c in candidates]
        low, high = min(depths), max(depths)
        if high == low:
            return [1.0] * len(candidates)
        return [(high - d) / (high - low) for d in depths]


class ResidencyScorer:
    """GPU-resident 1.0, in host memory 0.7, absent 0.0 (the tiers llm-d's load-state scorer uses)."""

    name = "residency"
    reads_load = True
    tiers = {Residency.GPU: 1.0, Residency.HOST: 0.7, Residency.NONE: 0.0}

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        if request.adapter is None:
            return [1.0] * len(candidates)
        return [self.tiers[c.residency] for c in candidates]


# ---- pickers --------------------------------------------------------------------------------


class WeightedRandomPicker:
    """P(candidate) ∝ its score; uniform when every score is 0."""

    name = "weighted-random"

    def pick(self, candidates: list[Candidate], scores: list[float], rng: random.Random) -> Candidate:
        total = sum(scores)
        if total <= 0:
            return candidates[rng.randrange(len(candidates))]
        point = rng.random() * total
        for candidate, score in zip(candidates, scores, strict=True):
            point -= score
            if point < 0:
                return candidate
        return candidates[-1]  # rounding left `point` at ~0 after the last positive score


class MaxScorePicker:
    """The best score; ties broken at random."""

    name = "max-score"

    def pick(self, candidates: list[Candidate], scores: list[float], rng: random.Random) -> Candidate:
        best = max(scores)
        return rng.choice([c for c, s in zip(candidates, scores, strict=True) if s >= best - 1e-12])


# ---- profile --------------------------------------------------------------------------------


@dataclass
class Profile:
    """One run of filters -> weighted scorers -> picker.

    `fallback` picks instead when a filter or scorer that reads the live batch would run and a
    surviving candidate has none (an agent that does not report it, a stale heartbeat)."""

    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker
    rng: random.Random = field(default_factory=random.Random)
    fallback: Profile | None = None

    @property
    def reads_load(self) -> bool:
        """Whether a pick can depend on live server state (queue depth, residency, batch) through a
        scorer or a filter that says so. The plain filters read it only in AssignedFilter's
        fallback, when no candidate has φ > 0."""
        return (any(scorer.reads_load for scorer, _ in self.scorers)
                or any(getattr(f, "reads_load", False) for f in self.filters))

    @property
    def reads_batch(self) -> bool:
        """Whether a pick reads `Candidate.batch` (the twin builds it only then)."""
        return (any(getattr(scorer, "reads_batch", False) for scorer, _ in self.scorers)
                or any(getattr(f, "reads_batch", False) for f in self.filters))

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        survivors = list(candidates)
        if not survivors:
            raise NoCandidateError("no servers")
        for f in self.filters:
            fallback = self._fallback(survivors) if getattr(f, "reads_batch", False) else None
            if fallback is not None:
                return fallback.pick(request, survivors)
            survivors = f.filter(request, survivors)
            if not survivors:
                raise NoCandidateError(f.name)
        fallback = self._fallback(survivors) if any(getattr(s, "reads_batch", False) for s, _ in self.scorers) else None
        if fallback is not None:
            return fallback.pick(request, survivors)
        return self.picker.pick(survivors, self._scores(request, survivors), self.rng)

    def _fallback(self, candidates: list[Candidate]) -> Profile | None:
        """The fallback profile when one of `candidates` has no live batch, else None."""
        if self.fallback is not None and any(c.batch is None for c in candidates):
            return self.fallback
        return None

    def _scores(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        total = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            scores = clamp_unit(scorer.score(request, candidates))
            total = [t + weight * s for t, s in zip(total, scores, strict=True)]
        return total


def clamp_unit(values: list[float]) -> list[float]:
    """Every value clamped into [0, 1]. The list itself when all are in range already (the usual case:
    min and max check that without a Python-level pass; clamping leaves NaN as it is either way)."""
    if not values or (min(values) >= 0.0 and max(values) <= 1.0):
        return values
    return [min(max(v, 0.0), 1.0) for v in values]


FILTERS: dict[str, Callable[[], Filter]] = {
    f.name: f for f in (HealthyFilter, RankFilter, AssignedFilter, SloFilter, PrefixFilter)}
SCORERS: dict[str, Callable[[], Scorer]] = {
    s.name: s for s in (PhiScorer, QueueScorer, ResidencyScorer, RankAwareScorer)}
PICKERS: dict[str, Callable[[], Picker]] = {
    p.name: p for p in (WeightedRandomPicker, MaxScorePicker)}
_RANK_AWARE = (SloFilter, RankAwareScorer)  # built with the profile's RankAwareConfig

DEFAULT_FILTERS = ("healthy", "rank", "assigned")


@dataclass(frozen=True)
class ProfileSpec:
    """A named profile: scorer weights, picker, filters in order, and the profile that picks when a
    candidate lacks the live batch this one reads."""

    scorers: dict[str, float]
    picker: str
    filters: tuple[str, ...] = DEFAULT_FILTERS
    fallback: str | None = None


PROFILES: dict[str, ProfileSpec] = {
    "loraserve": ProfileSpec({"phi": 1.0}, "weighted-random"),
    "load-aware": ProfileSpec({"phi": 1.0, "queue": 1.0, "residency": 0.5}, "weighted-random"),
    "least-loaded": ProfileSpec({"queue": 1.0}, "max-score"),
    # Toppings' Algorithm 1 over the servers the table assigns the adapter to; φ routing without batches
    "rank-aware": ProfileSpec({"rank-aware": 1.0}, "max-score", DEFAULT_FILTERS + ("slo",), "loraserve"),
    # the servers holding the request's longest cached prefix under a load ceiling, then as above
    "prefix-aware": ProfileSpec({"phi": 1.0}, "weighted-random", DEFAULT_FILTERS + ("prefix",)),
    "prefix-rank-aware": ProfileSpec({"rank-aware": 1.0}, "max-score", DEFAULT_FILTERS + ("slo", "prefix"),
                                     "prefix-aware"),
}


def make_profile(name: str = "loraserve", rng: random.Random | None = None,
                 scorers: dict[str, float] | None = None, picker: str | None = None,
                 rank_aware: RankAwareConfig | None = None, prefix: PrefixConfig | None = None) -> Profile:
    """Build a profile by name; `scorers` and `picker` override the named profile's choices.
    `rank_aware` configures the `slo` filter and the `rank-aware` scorer (latency model, SLO);
    `prefix` the `prefix` filter (and the router's prefix index)."""
    if name not in PROFILES:
        raise ValueError(f"unknown routing profile {name!r}; choose one of {sorted(PROFILES)}")
    spec = PROFILES[name]
    weights = scorers if scorers is not None else spec.scorers
    picker_name = picker or spec.picker
    unknown = sorted(set(weights) - set(SCORERS)) + ([picker_name] if picker_name not in PICKERS else [])
    if unknown:
        raise ValueError(f"unknown scorer or picker {unknown}; scorers: {sorted(SCORERS)}, "
                         f"pickers: {sorted(PICKERS)}")
    if any(w < 0 for w in weights.values()):
        raise ValueError(f"scorer weights must be >= 0, got {weights}")
    rng = rng or random.Random()
    config = rank_aware or RankAwareConfig()
    prefix = prefix or PrefixConfig()

    def build(factory: Callable) -> Any:
        if factory in _RANK_AWARE:
            return factory(config)
        return factory(prefix) if factory is PrefixFilter else factory()

    return Profile(filters=[build(FILTERS[n]) for n in spec.filters],
                   scorers=[(build(SCORERS[n]), w) for n, w in weights.items()],
                   picker=PICKERS[picker_name](), rng=rng,
                   fallback=make_profile(spec.fallback, rng, prefix=prefix) if spec.fallback else None)


def configured_by_options(profile: Profile) -> set[str]:
    """Which options `profile` reads: 'rank-aware' when a filter or scorer reads its RankAwareConfig,
    'prefix' when it has the prefix filter."""
    parts = [*profile.filters, *(s for s, _ in profile.scorers)]
    return ({"rank-aware"} if any(isinstance(p, _RANK_AWARE) for p in parts) else set()) | (
        {"prefix"} if prefix_config(profile) else set())


def prefix_config(profile: Profile) -> PrefixConfig | None:
    """The config of the profile's prefix filter; None when it has none (the router keeps no index)."""
    return next((f.config for f in profile.filters if isinstance(f, PrefixFilter)), None)


def parse_weights(text: str) -> dict[str, float]:
    """'phi=1,queue=0.5' -> {'phi': 1.0, 'queue': 0.5} (CLI and config helper)."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weights[name.strip()] = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"bad scorer weight {part!r}; write NAME=NUMBER") from None
    return weights
