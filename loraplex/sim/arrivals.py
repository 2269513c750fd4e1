"""Arrival times: a Gamma renewal process (Poisson when cv = 1) under a time-varying rate.

The process runs in operational time: unit-rate renewals u_1 < u_2 < ... are mapped through the
inverse of the cumulative rate Lambda(t) = integral of lambda, so the local inter-arrival CV is the
stated one and the mean rate follows lambda(t) = rps * D(t) * N(t) / mean(D * N).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from loraplex.sim.azure import load_azure


class Diurnal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    period_s: float = Field(86400.0, gt=0)  # compress for short runs, e.g. 1800 -> one "day" per run
    peak_to_trough: float = Field(2.0, ge=1)  # 2:1 Azure conv weekdays, 10:1 Azure code
    phase_s: float = 0.0


class Arrivals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    process: Literal["poisson", "gamma", "replay"] = "poisson"
    cv: float = Field(1.0, gt=0)  # gamma: inter-arrival coefficient of variation (poisson forces 1)
    diurnal: Diurnal | None = None
    minute_noise_sigma: float = Field(0.0, ge=0)  # lognormal per-minute rate noise (Azure conv ~0.2)
    replay_service: Literal["conv", "code"] = "conv"  # replay: whose timestamps, scaled to rps


GRID_S = 1.0  # resolution of the rate function


def arrival_times(spec: Arrivals, rps: float, duration_s: float, rng: np.random.Generator,
                  traces_dir: str | None = None) -> np.ndarray:
    if spec.process == "replay":
        return replay(spec.replay_service, rps, duration_s, traces_dir)[0]
    edges = np.arange(0.0, duration_s + GRID_S, GRID_S)
    rate = rate_curve(spec, rps, edges[:-1] + GRID_S / 2, rng)
    cumulative = np.concatenate([[0.0], np.cumsum(rate * np.diff(edges))])
    cv = 1.0 if spec.process == "poisson" else spec.cv
    units = _renewals(cumulative[-1], cv, rng)
    return np.interp(units, cumulative, edges)


def rate_curve(spec: Arrivals, rps: float, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    shape = np.ones_like(t)
    if spec.diurnal is not None:
        d = spec.diurnal
        amplitude = (d.peak_to_trough - 1) / (d.peak_to_trough + 1)
        shape *= 1 + amplitude * np.sin(2 * np.pi * (t - d.phase_s) / d.period_s)
    if spec.minute_noise_sigma > 0:
        minutes = (t // 60).astype(int)
        noise = rng.lognormal(0.0, spec.minute_noise_sigma, size=minutes.max() + 1)
        shape *= noise[minutes]
    return rps * shape / shape.mean()


def _renewals(total: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Event times of a unit-rate Gamma renewal process on [0, total)."""
    k = 1.0 / cv**2
    events: list[np.ndarray] = []
    now = 0.0
    while now < total:
        batch = np.cumsum(rng.gamma(k, 1.0 / k, size=max(64, int((total - now) * 1.1) + 16))) + now
        events.append(batch)
        now = batch[-1]
    times = np.concatenate(events)
    return times[times < total]


def replay(service: str, rps: float, duration_s: float, traces_dir: str | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The Azure hour's timestamps scaled so the mean rate is `rps`, repeated to fill `duration_s`;
    returns (arrival times, the trace row of each arrival)."""
    trace = load_azure(service, traces_dir)
    scale = len(trace) / trace.duration_s / rps  # seconds of replay per second of trace
    period = trace.duration_s * scale + 1.0 / rps  # one mean gap between repeats
    repeats = int(np.ceil(duration_s / period))
    times = np.concatenate([trace.arrival_s * scale + i * period for i in range(repeats)])
    rows = np.tile(np.arange(len(trace)), repeats)
    keep = times < duration_s
    return times[keep], rows[keep]
