"""Demand forecasts (Algorithm 1's EXTRAPOLATE) over the observed tokens/s of recent windows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Forecaster = Callable[[Sequence[float]], float]


def last_window(series: Sequence[float]) -> float:
    """The paper's simplest reading: next step's demand = the last step's."""
    return series[-1] if series else 0.0


def ewma(series: Sequence[float], alpha: float = 0.5) -> float:
    """Exponentially weighted mean, newest weighted `alpha`: smooths bursts, follows drift in a few windows."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"ewma alpha must be in (0, 1], got {alpha}")
    if not series:
        return 0.0
    level = series[0]
    for value in series[1:]:
        level = alpha * value + (1.0 - alpha) * level
    return max(level, 0.0)


def mean(series: Sequence[float]) -> float:
    return sum(series) / len(series) if series else 0.0


FORECASTERS: dict[str, Forecaster] = {"ewma": ewma, "last": last_window, "mean": mean}


def make_forecaster(name: str) -> Forecaster:
    if name not in FORECASTERS:
        raise ValueError(f"unknown forecaster {name!r}; choose one of {sorted(FORECASTERS)}")
    return FORECASTERS[name]
