"""The cluster twin counts adapter moves (routes a table adds over the one before) and the time its
placement policy takes, for every policy, min-cost-flow included."""

from __future__ import annotations

import pytest

from loraplex.latency.profile import load_profile
from loraplex.placement.operating_points import DEFAULT_CPU
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate


@pytest.mark.parametrize("placement", ["replicate-all", "min-cost-flow", "loraserve"])
def test_moves_and_placement_time_are_reported(placement):
    spec = WorkloadSpec(duration_s=20, rps=40, adapters=Adapters(count=30),
                        lengths=Lengths(profile="uniform", uniform_range=(8, 100), max_model_len=2048))
    config = ClusterConfig(servers=4, interval_s=5, placement=placement, operating_points=DEFAULT_CPU)
    run = simulate_cluster(generate(spec), load_profile("cpu-tiny"), config)
    assert run.info["placements"] >= 3 and run.info["placement_s"] > 0
    if placement == "replicate-all":  # every adapter everywhere, every time: nothing to load
        assert run.info["adapter_moves"] == 0
    assert run.summary.finished > 0
