"""Rank-aware routing: Toppings' Algorithm 1 (`papers/toppings.md` §3.11) as one filter and one scorer
of the routing pipeline. Pure: the router and the twin run this very code.

For a request of rank r and each candidate server, from the batch the server reported (its open
requests counted by rank, `ServerBatch`) and a step-latency model linear in the twin's step features
(whose rank terms are Toppings' Eq. 2: Σ ranks for unpadded kernels, batch × max rank for BGMV):

    Δ_prefill = PrePerf(queue + req) - PrePerf(queue)       the request's own prompt tokens
    Δ_decode  = DecPerf(exists + req) - DecPerf(exists)      one decode step of the whole batch
    cost      = Δ_prefill / avg_output_tokens + Δ_decode     extra seconds per token, for each request there
    total     = cost × len(exists)                           extra seconds per token, summed over them

A server breaks the SLO when DecPerf(exists + req) > SLO. The `slo` filter drops those servers and the
`rank-aware` scorer scores the rest by `total` (the lowest scores 1); the max-score picker takes the best.

What the paper leaves open, decided here (notes §3.11):
- PERF(∅) = 0: an idle server has nobody to slow down, so its total is 0 and it wins; ties are broken
  at random by the picker.
- every candidate would break the SLO: the filter keeps them all and the scorer's total decides, i.e.
  the lexicographic key (violates, total): the request goes where it slows the others least. The
  penalty is a filter, not an infinite cost, so `inf × 0` (NaN) cannot arise.
- a candidate without a batch (an agent that does not report one, a stale heartbeat): the
  `rank-aware` profile routes the request with its fallback profile (LoRAServe's φ) instead, so
  missing information degrades to today's routing. Used on their own, the filter keeps such a server
  and the scorer ranks it last.
- PrePerf has token terms (prompt tokens, tokens × rank): our extension; the fixed per-step terms
  are charged once, by DecPerf.
- the request's prompt length: `RouteRequest.prompt_tokens` when the router knows it, else
  `prompt_tokens`; `avg_output_tokens` is one constant, as in the paper.
- adapter loads (`loads`, `load_rank_sum`) are not modelled: residency is the `residency` scorer's
  business, and Toppings hides the load behind CPU-assisted prefill.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.routing.records import ServerBatch
from loraplex.util.args import typed_options

if TYPE_CHECKING:
    from loraplex.routing.pipeline import Candidate, RouteRequest

# The step-latency terms the router evaluates (the names of `loraplex.latency.features.FEATURES`).
DECODE_TERMS = ("intercept", "batch", "adapters", "batch_x_adapters", "rank_sum", "batch_x_max_rank",
                "context_tokens", "padded_context")
PREFILL_TERMS = ("prefill_tokens", "prefill_rank_tokens")
# adapter copies: not a routing cost here (module docstring); a prompt chunk's attention over the KV
# cached before it: the router's prefill estimate (PrePerf) knows no server's cache
IGNORED_TERMS = ("loads", "load_rank_sum", "prefill_context")


@dataclass(frozen=True)
class BatchShape:
    """What the latency terms read of a batch in which every open request decodes one token."""

    requests: int = 0
    adapters: int = 0
    rank_sum: int = 0
    max_rank: int = 0
    context_tokens: int = 0
    max_context: int = 0
    prefill_tokens: int = 0  # prompt tokens still to prefill (the queue's PrePerf)
    prefill_rank_tokens: int = 0

    @classmethod
    def of(cls, batch: ServerBatch) -> BatchShape:
        present = [r for r in batch.ranks if r.requests > 0]
        return cls(requests=sum(r.requests for r in present), adapters=len(batch.adapters),
                   rank_sum=sum(r.rank * r.requests for r in present),
                   max_rank=max((r.rank for r in present), default=0),
                   context_tokens=batch.context_tokens, max_context=batch.max_context,
                   prefill_tokens=sum(r.prefill_tokens for r in present),
                   prefill_rank_tokens=sum(r.rank * r.prefill_tokens for r in present))

    def plus(self, rank: int, new_adapter: bool, prompt_tokens: int) -> BatchShape:
        """This batch with one more request of `rank` and `prompt_tokens` not prefilled yet."""
        return BatchShape(self.requests + 1, self.adapters + (1 if new_adapter and rank > 0 else 0),
                          self.rank_sum + rank, max(self.max_rank, rank), self.context_tokens + prompt_tokens,
                          max(self.max_context, prompt_tokens), self.prefill_tokens + prompt_tokens,
                          self.prefill_rank_tokens + rank * prompt_tokens)


@dataclass(frozen=True)
class LatencyModel:
    """Seconds per unit of each step-latency term (a profile's `coefficients`; absent terms are 0)."""

    coefficients: Mapping[str, float]
    name: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(DECODE_TERMS) - set(PREFILL_TERMS))
        if unknown:
            raise ValueError(f"unknown latency terms {unknown}; known: {list(DECODE_TERMS + PREFILL_TERMS)}")
        if not all(math.isfinite(v) for v in self.coefficients.values()):
            raise ValueError(f"latency coefficients must be finite, got {dict(self.coefficients)}")

    @classmethod
    def from_coefficients(cls, coefficients: Mapping[str, float], name: str = "") -> LatencyModel:
        """A profile's coefficients without the terms the router does not evaluate (adapter loads)."""
        return cls({k: float(v) for k, v in coefficients.items() if k not in IGNORED_TERMS}, name)

    @classmethod
    def load(cls, name_or_path: str) -> LatencyModel:
        """A profile file (JSON with `coefficients`, as `loraplex profile` writes) or a shipped one by name."""
        path = Path(name_or_path)
        if path.is_file():
            try:
                doc = json.loads(path.read_text())
                return cls.from_coefficients(doc["coefficients"], str(doc.get("name", path.stem)))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}: not a latency profile: {exc}") from None
        from loraplex.latency.profile import load_profile  # shipped profiles; imported only when asked for

        try:
            profile = load_profile(name_or_path)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        return cls.from_coefficients(profile.coefficients, profile.name)

    def decode_seconds(self, shape: BatchShape, lora: bool = True) -> float:
        """DecPerf: one decode step of every request of `shape` (0 for an empty batch). `lora=False`:
        the same batch on the base model alone (no adapter or rank terms)."""
        n = shape.requests
        if n == 0:
            return 0.0
        c = self.coefficients.get
        seconds = (c("intercept", 0.0) + c("batch", 0.0) * n + c("context_tokens", 0.0) * shape.context_tokens
                   + c("padded_context", 0.0) * n * shape.max_context)
        if lora:
            seconds += (c("adapters", 0.0) * shape.adapters + c("batch_x_adapters", 0.0) * n * shape.adapters
                        + c("rank_sum", 0.0) * shape.rank_sum + c("batch_x_max_rank", 0.0) * n * shape.max_rank)
        return seconds

    def prefill_seconds(self, tokens: int, rank_tokens: int) -> float:
        """PrePerf's token terms: prefilling `tokens` prompt tokens whose ranks sum to `rank_tokens`."""
        c = self.coefficients.get
        return c("prefill_tokens", 0.0) * tokens + c("prefill_rank_tokens", 0.0) * rank_tokens


# Toppings' Fig. 6 example fitted to Eq. 2 (BGMV; notes §6.1): Llama2-7B on an A100, 31.8 ms per step
# and 1/256 ms per sequence per rank of the batch's largest rank. A stand-in until a profile is given.
PAPER_BGMV = LatencyModel({"intercept": 31.8e-3, "batch_x_max_rank": 1e-3 / 256}, "toppings-fig6-bgmv")


@dataclass(frozen=True)
class Estimate:
    """Algorithm 1 for one server: `cost_s` is Δ_prefill / avg_output_tokens + Δ_decode."""

    requests: int  # open requests on the server before this one
    cost_s: float
    decode_s: float  # DecPerf(exists + req): its time per token with the request
    slo_s: float

    @property
    def total_s(self) -> float:
        """The extra time per token the request costs everyone already there (0 on an idle server)."""
        return self.cost_s * self.requests

    @property
    def violates(self) -> bool:
        return self.decode_s > self.slo_s


@dataclass(frozen=True)
class RankAwareConfig:
    """The latency model, the SLO and the constants of Algorithm 1.

    `slo_tpot_s`: the bound on a decode step (time per output token). None: `slo_factor` times the
    same batch's step on the base model alone, the paper's "1.5x the time per token without LoRA"
    taken at the server's own batch, since the router has no fixed reference load."""

    model: LatencyModel = PAPER_BGMV
    slo_tpot_s: float | None = None
    slo_factor: float = 1.5
    avg_output_tokens: float = 128.0
    prompt_tokens: int = 512  # assumed when the router does not know a request's prompt length

    def __post_init__(self) -> None:
        if self.slo_tpot_s is not None and not self.slo_tpot_s > 0:
            raise ValueError(f"slo_tpot_s must be positive, got {self.slo_tpot_s}")
        if not (self.slo_factor > 0 and self.avg_output_tokens > 0 and self.prompt_tokens >= 0):
            raise ValueError("slo_factor and avg_output_tokens must be positive, prompt_tokens >= 0")

    def estimate(self, request: RouteRequest, batch: ServerBatch) -> Estimate:
        rank = request.rank or 0
        prompt = self.prompt_tokens if request.prompt_tokens is None else request.prompt_tokens
        before = BatchShape.of(batch)
        after = before.plus(rank, request.adapter not in batch.adapters, prompt)
        model = self.model
        decode_after = model.decode_seconds(after)
        cost = (model.prefill_seconds(prompt, rank * prompt) / self.avg_output_tokens
                + decode_after - model.decode_seconds(before))
        slo = self.slo_tpot_s if self.slo_tpot_s is not None else self.slo_factor * model.decode_seconds(after, False)
        return Estimate(before.requests, cost, decode_after, slo)

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> RankAwareConfig:
        """From KEY=VALUE options (the router's flags): latency_profile (a profile file or shipped
        name), slo_tpot_s, slo_factor, avg_output_tokens, prompt_tokens."""
        numbers = {"slo_tpot_s": float, "slo_factor": float, "avg_output_tokens": float, "prompt_tokens": int}
        unknown = sorted(set(options) - set(numbers) - {"latency_profile"})
        if unknown:
            raise ValueError(f"unknown rank-aware options {unknown}; known: latency_profile, {', '.join(numbers)}")
        fields = typed_options(options, numbers, "rank-aware")
        if "latency_profile" in options:
            fields["model"] = LatencyModel.load(options["latency_profile"])
        return cls(**fields)


def parse_options(pairs: list[str]) -> dict[str, str]:
    """['slo_tpot_s=0.05', ...] -> {'slo_tpot_s': '0.05'} (a repeatable CLI flag)."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad routing option {pair!r}; write KEY=VALUE")
        options[key.strip()] = value.strip()
    return options


@dataclass
class SloFilter:
    """Drops servers whose predicted time per token with the request would break the SLO; keeps
    every server when all would (the scorer then sends it where it hurts least)."""

    config: RankAwareConfig = field(default_factory=RankAwareConfig)
    name = "slo"
    reads_load = True
    reads_batch = True

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        estimate = self.config.estimate
        kept = [c for c in candidates if c.batch is None or not estimate(request, c.batch).violates]
        return kept or candidates


@dataclass
class RankAwareScorer:
    """Algorithm 1's total cost, min-max normalised: the lowest extra latency over everyone already on
    the server scores 1, the highest 0; a server without a batch scores 0."""

    config: RankAwareConfig = field(default_factory=RankAwareConfig)
    name = "rank-aware"
    reads_load = True
    reads_batch = True

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        estimate = self.config.estimate
        totals = [None if c.batch is None else estimate(request, c.batch).total_s for c in candidates]
        known = [t for t in totals if t is not None]
        if not known:
            return [1.0] * len(candidates)
        low, high = min(known), max(known)
        if high - low <= 1e-15:
            return [0.0 if t is None else 1.0 for t in totals]
        return [0.0 if t is None else (high - t) / (high - low) for t in totals]
