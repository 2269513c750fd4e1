"""Least-squares fit of the step-latency model to measured steps (numpy only).

Coefficients are kept non-negative (a term that would come out negative is dropped and the rest
refitted), so the model never predicts that more work takes less time. The error minimised is
relative (rows weighted by 1/measured time): plain least squares lets the few long prefill steps
of an overloaded run decide the fit, while the many short steps decide latency at moderate load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loraplex.latency.features import FEATURES, StepFeatures
from loraplex.latency.profile import FitReport


def fit_latency(samples: Sequence[tuple[StepFeatures, float]], terms: Sequence[str] = FEATURES
                ) -> tuple[dict[str, float], FitReport]:
    """(coefficients per term, report) from (features, measured seconds) pairs."""
    if len(samples) < len(terms):
        raise ValueError(f"need at least {len(terms)} measured steps to fit, got {len(samples)}")
    unknown = set(terms) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown latency terms {sorted(unknown)}")
    columns = [FEATURES.index(t) for t in terms]
    x = np.asarray([f.vector() for f, _ in samples], dtype=float)[:, columns]
    y = np.asarray([s for _, s in samples], dtype=float)
    weight = 1.0 / np.maximum(y, 1e-6)
    coef = _nonnegative_lstsq(x * weight[:, None], y * weight)
    predicted = x @ coef
    report = FitReport(samples=len(y), r2=_r2(y, predicted),
                       mape=float(np.mean(np.abs(predicted - y) / np.maximum(y, 1e-9))),
                       total_time_error=float((predicted.sum() - y.sum()) / y.sum()))
    return {t: float(c) for t, c in zip(terms, coef, strict=True) if c > 0}, report


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    scale = np.abs(x).max(axis=0)
    active = [j for j in range(x.shape[1]) if scale[j] > 0]
    while True:
        coef = np.zeros(x.shape[1])
        # columns scaled to [0, 1]: the terms span six orders of magnitude
        coef[active] = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0] / scale[active]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def _r2(y: np.ndarray, predicted: np.ndarray) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
