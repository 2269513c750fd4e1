"""Operating points: the most tokens/s one server sustains under the SLO when it serves adapters of a
single rank (LoRAServe's OP[r], profiled offline). u(a) = demand_tps(a) / OP[rank(a)] is an adapter's
load in server-equivalents."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class OperatingPointsError(ValueError):
    """A profile that is missing, malformed or not positive."""


@dataclass(frozen=True)
class OperatingPoints:
    """`tokens_per_second[rank]` = OP[rank]. Ranks between profiled ones are interpolated linearly in
    log2(rank); ranks outside the profile use the nearest profiled rank."""

    tokens_per_second: Mapping[int, float]
    source: str = ""  # where the numbers come from (a profile file, "default-gpu", ...)
    _ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens_per_second:
            raise OperatingPointsError("operating points need at least one rank")
        for rank, tps in self.tokens_per_second.items():
            if not (isinstance(rank, int) and rank > 0 and math.isfinite(tps) and tps > 0):
                raise OperatingPointsError(f"operating point {rank}: {tps} must be a positive rank and tokens/s")
        object.__setattr__(self, "_ranks", tuple(sorted(self.tokens_per_second)))

    def tps(self, rank: int) -> float:
        ranks, op = self._ranks, self.tokens_per_second
        if rank in op:
            return op[rank]
        if rank <= ranks[0]:
            return op[ranks[0]]
        if rank >= ranks[-1]:
            return op[ranks[-1]]
        hi = bisect.bisect_left(ranks, rank)
        lo_r, hi_r = ranks[hi - 1], ranks[hi]
        t = (math.log2(rank) - math.log2(lo_r)) / (math.log2(hi_r) - math.log2(lo_r))
        return op[lo_r] + t * (op[hi_r] - op[lo_r])

    @classmethod
    def from_dict(cls, doc: Mapping[str, object], source: str = "") -> OperatingPoints:
        """Parses `{"tokens_per_second": {"8": 4000, "16": 3600, ...}, ...}` (other keys are kept by the
        profiler for people: device, model, slo)."""
        table = doc.get("tokens_per_second")
        if not isinstance(table, Mapping):
            raise OperatingPointsError(f"{source or 'profile'}: needs a 'tokens_per_second' object of rank -> tps")
        try:
            points = {int(rank): float(tps) for rank, tps in table.items()}
        except (TypeError, ValueError) as exc:
            raise OperatingPointsError(f"{source or 'profile'}: {exc}") from exc
        return cls(points, source)

    @classmethod
    def load(cls, path: str | Path) -> OperatingPoints:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise OperatingPointsError(f"cannot read operating points from {path}: {exc}") from exc
        if not isinstance(doc, Mapping):
            raise OperatingPointsError(f"{path}: expected a JSON object")
        return cls.from_dict(doc, str(path))

    def to_dict(self) -> dict[str, object]:
        return {"tokens_per_second": {str(r): self.tokens_per_second[r] for r in self._ranks}, "source": self.source}


# Placeholders until `loraplex` profiles the real engine: the ratio OP[8]/OP[128] = 2 follows the
# paper's rank-128-prefill-costs-2.7x measurement, tempered for decode. Replace with a profile.
DEFAULT_GPU = OperatingPoints({8: 12000.0, 16: 11000.0, 32: 9600.0, 64: 7800.0, 128: 6000.0}, "default-gpu")
# The tiny CPU model of `loraplex up`: small numbers so a handful of test requests moves placement.
DEFAULT_CPU = OperatingPoints({8: 400.0, 16: 380.0, 32: 350.0, 64: 300.0, 128: 250.0}, "default-cpu")


def default_operating_points(device: str) -> OperatingPoints:
    if device not in ("cpu", "gpu"):
        raise OperatingPointsError(f"unknown device {device!r}: use 'cpu' or 'gpu', or load a profile")
    return DEFAULT_CPU if device == "cpu" else DEFAULT_GPU
