"""The twin's shortcuts give exactly the results of the plain paths they replace."""

from __future__ import annotations

import gc
import weakref

from loraplex.latency.profile import load_profile
from loraplex.placement.operating_points import DEFAULT_CPU
from loraplex.routing.pipeline import PhiScorer, make_profile
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.replay import replay_sampling
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate


def test_a_router_that_reads_no_load_picks_as_if_every_candidate_were_stepped(monkeypatch):
    spec = WorkloadSpec(duration_s=20, rps=60, adapters=Adapters(count=30),
                        lengths=Lengths(profile="uniform", uniform_range=(8, 200), max_model_len=2048))
    trace, profile = generate(spec), load_profile("cpu-tiny")
    config = ClusterConfig(servers=6, interval_s=5, operating_points=DEFAULT_CPU)
    assert not make_profile("loraserve").reads_load
    from_table = simulate_cluster(trace, profile, config)
    # Declaring that φ reads load makes the cluster step every candidate and read its live state.
    monkeypatch.setattr(PhiScorer, "reads_load", True)
    assert make_profile("loraserve").reads_load
    stepped = simulate_cluster(trace, profile, config)
    assert from_table.results == stepped.results and from_table.summary == stepped.summary
    assert min(from_table.info["requests_per_server"]) > 0  # the picks really spread over servers


def test_the_collector_pause_restores_what_was_set():
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_run_starts_by_freeing_the_cycles_earlier_runs_left() -> None:
    """A finished run's prefix trees are cyclic garbage (nodes point at their parents): the next run's
    pause collects them first, or a rate search would keep every probe's servers (it grew 110 MB a
    16-server probe)."""

    class Node:
        parent: Node | None = None

    with cyclic_gc_paused():
        child = Node()
        child.parent = Node()
        child.parent.child = child  # a cycle, as a tree node and its parent make
        ref = weakref.ref(child)
        del child
    with cyclic_gc_paused():
        assert ref() is None


def test_replayed_requests_of_one_length_share_their_sampling_params():
    assert replay_sampling(7) is replay_sampling(7)
    params = replay_sampling(7)
    assert (params.max_tokens, params.ignore_eos, params.temperature) == (7, True, 0.0)
