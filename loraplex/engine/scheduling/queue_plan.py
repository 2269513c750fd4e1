"""How many size queues, and where they split: 1-D K-means over recent WRS values, K by an elbow.

K-means in one dimension works on sorted values: every cluster is a contiguous run, so one Lloyd
iteration is a few binary searches and prefix sums. Seeds are deterministic (no random restarts):
K equal-count runs, or the K-1 fit with its widest cluster split. WCSS never grows with K, so the K of minimal WCSS is
always the largest; the elbow rule takes the smallest K after which one more queue removes less
than `elbow_gain` of the total spread WCSS(1). Boundaries sit halfway between adjacent centroids;
queue i takes boundary[i-1] <= WRS < boundary[i].
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class KMeans:
    centroids: list[float]  # ascending
    wcss: float


def kmeans_path(values: Sequence[float], max_k: int, max_iter: int = 100) -> list[KMeans]:
    """K-means for K = 1, 2, ... up to `max_k` (fewer when the values run out of distinct points).
    K starts from the better of two seeds: K equal-count runs, and the K-1 solution with its
    widest cluster split at its mean. Lloyd's iterations never raise WCSS, so WCSS never grows with K."""
    xs = sorted(values)
    if not xs:
        raise ValueError("k-means needs at least one value")
    n = len(xs)
    prefix = [0.0, *accumulate(xs)]
    prefix_sq = [0.0, *accumulate(x * x for x in xs)]
    fits: list[KMeans] = []
    best_cuts = [0, n]
    for k in range(1, min(max_k, len(set(xs))) + 1):
        seeds = [_drop_empty([round(n * i / k) for i in range(k + 1)])]
        if k > 1:
            seeds.append(_split_widest(xs, prefix, prefix_sq, best_cuts))
        runs = [_lloyd(xs, prefix, prefix_sq, cuts, max_iter) for cuts in seeds if len(cuts) == k + 1]
        runs = [run for run in runs if len(run[1].centroids) == k]  # a run may empty (near-equal values)
        if not runs:
            break
        cuts, fit = min(runs, key=lambda run: run[1].wcss)
        fits.append(fit)
        best_cuts = cuts
    return fits


def kmeans_1d(values: Sequence[float], k: int, max_iter: int = 100) -> KMeans:
    """The K-means fit with at most `k` clusters (fewer when there are fewer distinct values)."""
    return kmeans_path(values, k, max_iter)[-1]


def _lloyd(xs: list[float], prefix: list[float], prefix_sq: list[float], cuts: list[int],
           max_iter: int) -> tuple[list[int], KMeans]:
    centroids = _means(prefix, cuts)
    for _ in range(max_iter):
        mids = boundaries(centroids)
        new_cuts = _drop_empty([0, *(bisect_left(xs, m) for m in mids), len(xs)])
        if new_cuts == cuts:
            break
        cuts = new_cuts
        centroids = _means(prefix, cuts)
    return cuts, KMeans(centroids, _wcss(prefix, prefix_sq, cuts))


def _split_widest(xs: list[float], prefix: list[float], prefix_sq: list[float], cuts: list[int]) -> list[int]:
    """`cuts` with the run of the largest WCSS split at its mean (unchanged if no run can split)."""
    runs = [(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False) if xs[lo] != xs[hi - 1]]
    if not runs:
        return cuts
    lo, hi = max(runs, key=lambda run: _wcss(prefix, prefix_sq, list(run)))
    mean = (prefix[hi] - prefix[lo]) / (hi - lo)
    at = bisect_left(xs, mean, lo, hi)
    if at in (lo, hi):  # all equal: mean sits on the first value
        at = bisect_right(xs, mean, lo, hi)
    return sorted({*cuts, at}) if lo < at < hi else cuts


def _wcss(prefix: list[float], prefix_sq: list[float], cuts: list[int]) -> float:
    total = 0.0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        s = prefix[hi] - prefix[lo]
        total += (prefix_sq[hi] - prefix_sq[lo]) - s * s / (hi - lo)
    return max(0.0, total)


def _means(prefix: list[float], cuts: list[int]) -> list[float]:
    return [(prefix[hi] - prefix[lo]) / (hi - lo) for lo, hi in zip(cuts, cuts[1:], strict=False)]


def _drop_empty(cuts: list[int]) -> list[int]:
    kept = [cuts[0]]
    for c in cuts[1:]:
        if c > kept[-1]:
            kept.append(c)
    return kept


def choose_k(wcss: Sequence[float], elbow_gain: float) -> int:
    """`wcss[i]` is WCSS with i+1 clusters. The smallest K whose next cluster would remove less than
    `elbow_gain * WCSS(1)`; the largest K when every step still pays."""
    total = wcss[0]
    if total <= 0.0:
        return 1
    for k in range(1, len(wcss)):
        if wcss[k - 1] - wcss[k] < elbow_gain * total:
            return k
    return len(wcss)


def boundaries(centroids: Sequence[float]) -> list[float]:
    return [(a + b) / 2 for a, b in zip(centroids, centroids[1:], strict=False)]


def plan_boundaries(values: Sequence[float], max_queues: int, elbow_gain: float) -> list[float]:
    """The queue boundaries for these WRS values: K-means for K = 1..max_queues, K by the elbow."""
    fits = kmeans_path(values, max_queues)
    k = choose_k([f.wcss for f in fits], elbow_gain)
    return boundaries(fits[k - 1].centroids)


def classify(wrs: float, bounds: Sequence[float]) -> int:
    """The queue of a request of size `wrs`: 0 below bounds[0], i for bounds[i-1] <= wrs < bounds[i]."""
    return bisect_right(bounds, wrs)
