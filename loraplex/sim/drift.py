"""Popularity drift: a multiplicative demand m_a(t) per adapter on a time grid (workloads.md §5).

The share of adapter a at time t is p_a * m_a(t) / sum_b p_b * m_b(t), so drift moves traffic
between adapters while the total rate stays lambda(t).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class DiurnalDrift(BaseModel):
    model_config = ConfigDict(extra="forbid")

    frac: float = Field(0.2, ge=0, le=1)  # share of adapters that follow a daily cycle
    amplitude: tuple[float, float] = (0.2, 0.8)  # drawn uniformly per adapter
    period_s: float = Field(86400.0, gt=0)


class Surge(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = Field(1, ge=0)  # adapters that surge
    at: tuple[float, float] = (0.3, 0.7)  # start, as a fraction of the duration, drawn uniformly
    ramp_s: float = Field(60.0, ge=0)
    factor: tuple[float, float] = (5.0, 10.0)
    hold_s: tuple[float, float] = (300.0, 3600.0)


class RandomWalk(BaseModel):
    """A mean-reverting random walk of log demand (Ornstein-Uhlenbeck), for every adapter."""

    model_config = ConfigDict(extra="forbid")

    sigma: float = Field(0.05, ge=0)  # log-demand change per sqrt(step)
    tau_s: float = Field(1800.0, gt=0)  # mean reversion time


class Drift(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step_s: float = Field(60.0, gt=0)
    diurnal: DiurnalDrift | None = None
    surge: Surge | None = None
    random_walk: RandomWalk | None = None


def demand(drift: Drift | None, count: int, duration_s: float, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray]:
    """(bucket start times [T], multipliers [T, count]). No drift: one bucket of ones."""
    if drift is None:
        return np.zeros(1), np.ones((1, count))
    t = np.arange(0.0, max(duration_s, drift.step_s), drift.step_s)
    m = np.ones((len(t), count))
    if drift.diurnal is not None:
        m *= _diurnal(drift.diurnal, t, count, rng)
    if drift.surge is not None:
        m *= _surge(drift.surge, t, count, duration_s, rng)
    if drift.random_walk is not None:
        m *= _random_walk(drift.random_walk, t, count, drift.step_s, rng)
    return t, m


def _diurnal(spec: DiurnalDrift, t: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    chosen = rng.random(count) < spec.frac
    amplitude = rng.uniform(*spec.amplitude, size=count) * chosen
    phase = rng.uniform(0, 2 * np.pi, size=count)
    return 1 + amplitude * np.sin(2 * np.pi * t[:, None] / spec.period_s + phase)


def _surge(spec: Surge, t: np.ndarray, count: int, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    m = np.ones((len(t), count))
    for adapter in rng.choice(count, size=min(spec.count, count), replace=False):
        start = rng.uniform(*spec.at) * duration_s
        factor, hold = rng.uniform(*spec.factor), rng.uniform(*spec.hold_s)
        rise = np.clip((t - start) / max(spec.ramp_s, 1e-9), 0, 1)
        fall = np.clip((start + spec.ramp_s + hold + spec.ramp_s - t) / max(spec.ramp_s, 1e-9), 0, 1)
        m[:, adapter] = 1 + (factor - 1) * np.minimum(rise, fall)
    return m


def _random_walk(spec: RandomWalk, t: np.ndarray, count: int, step_s: float,
                 rng: np.random.Generator) -> np.ndarray:
    keep = np.exp(-step_s / spec.tau_s)
    log_m = np.zeros((len(t), count))
    for i in range(1, len(t)):
        log_m[i] = keep * log_m[i - 1] + spec.sigma * rng.standard_normal(count)
    return np.exp(log_m)
