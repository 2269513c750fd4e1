"""The paper's ML surrogate: a throughput regressor and a starvation classifier over the 7 GPU
features, trained on twin runs (scikit-learn, imported only here and only when used).
`distill` replaces both forests by one shallow decision tree each (the paper's refinement)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loraplex.latency.profile import Profile
from loraplex.sim.metrics import Slo
from loraplex.sim.planner.greedy import TESTING_POINTS
from loraplex.sim.planner.oracle import GpuLoad, TwinOracle
from loraplex.sim.planner.workload import AdapterDemand

RATES = (3.2, 1.6, 0.8, 0.4, 0.1, 0.05, 0.025, 0.0125)  # req/s, the paper's set (shortened)
RANKS = (8, 16, 32, 64)


def random_gpu_load(rng: np.random.Generator, prompt_len: float, output_len: float, rate_scale: float) -> GpuLoad:
    """A GPU workload like the paper's training grid: A and A_max from the testing points (A_max <= A),
    three ranks and three rates spread over the adapters."""
    count = int(rng.choice([p for p in TESTING_POINTS if p <= 128]))
    a_max = int(rng.choice([p for p in TESTING_POINTS if p <= count]))
    ranks = rng.choice(RANKS, 3)
    rates = rng.choice(RATES, 3, replace=False) * rate_scale
    adapters = tuple(AdapterDemand(f"t{i}", int(ranks[i % 3]), float(rates[(i // 3) % 3])) for i in range(count))
    return GpuLoad(adapters, a_max, prompt_len, output_len)


@dataclass
class Surrogate:
    regressor: Any
    classifier: Any

    def throughput(self, gpu: GpuLoad) -> float:
        return float(self.regressor.predict([_on_grid(gpu).features()])[0])

    def starves(self, gpu: GpuLoad) -> bool:
        return bool(self.classifier.predict([_on_grid(gpu).features()])[0])


def _on_grid(gpu: GpuLoad) -> GpuLoad:
    """The models were trained with A >= A_max; a smaller (tail) GPU is padded up to A_max with
    adapters of the mean rate and the smallest rank, as the paper's code does."""
    missing = gpu.a_max - len(gpu.adapters)
    if missing <= 0:
        return gpu
    rate = sum(a.rate_rps for a in gpu.adapters) / len(gpu.adapters)
    rank = min(a.rank for a in gpu.adapters)
    padding = tuple(AdapterDemand(f"pad{i}", rank, rate) for i in range(missing))
    return GpuLoad(gpu.adapters + padding, gpu.a_max, gpu.prompt_len, gpu.output_len)


def twin_dataset(profile: Profile, samples: int, prompt_len: float, output_len: float, rate_scale: float = 1.0,
                 seed: int = 0, duration_s: float = 60.0, slo: Slo | None = None, slo_target: float = 0.0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, throughput, starved) of `samples` random GPU workloads run on the twin; with an
    `slo`, "starved" also means SLO attainment below `slo_target` (as TwinOracle judges it)."""
    rng = np.random.default_rng(seed)
    oracle = TwinOracle(profile, duration_s, seed, slo=slo, slo_target=slo_target)
    x, tps, starved = [], [], []
    for _ in range(samples):
        gpu = random_gpu_load(rng, prompt_len, output_len, rate_scale)
        x.append(gpu.features())
        tps.append(oracle.throughput(gpu))
        starved.append(oracle.starves(gpu))
    return np.asarray(x), np.asarray(tps), np.asarray(starved)


def train_surrogate(x: np.ndarray, tps: np.ndarray, starved: np.ndarray, seed: int = 0) -> Surrogate:
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

    regressor = RandomForestRegressor(n_estimators=128, random_state=seed).fit(x, tps)
    classifier = RandomForestClassifier(n_estimators=128, random_state=seed, class_weight="balanced").fit(x, starved)
    return Surrogate(regressor, classifier)


def distill(x: np.ndarray, tps: np.ndarray, starved: np.ndarray, max_depth: int = 5, seed: int = 0) -> Surrogate:
    """One shallow tree per question: at most 2^max_depth rules each (the paper keeps <= 32)."""
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    return Surrogate(DecisionTreeRegressor(max_depth=max_depth, random_state=seed).fit(x, tps),
                     DecisionTreeClassifier(max_depth=max_depth, random_state=seed, class_weight="balanced")
                     .fit(x, starved))
