"""The pure routing policy (loraplex.routing.pipeline): filters, scorers, pickers and profiles."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loraplex.routing.pipeline import (
    AssignedFilter,
    Candidate,
    MaxScorePicker,
    NoCandidateError,
    QueueScorer,
    Residency,
    RouteRequest,
    make_profile,
    parse_weights,
)

SQL = RouteRequest("sql", rank=16)


def servers(**phis: float) -> list[Candidate]:
    return [Candidate(name, phi=phi) for name, phi in phis.items()]


def test_loraserve_profile_picks_in_proportion_to_phi():
    profile = make_profile("loraserve", rng=random.Random(7))
    candidates = servers(a=0.1, b=0.6, c=0.3, d=0.0)
    n = 20000
    counts = Counter(profile.pick(SQL, candidates).server_id for _ in range(n))
    assert counts["d"] == 0
    for name, phi in (("a", 0.1), ("b", 0.6), ("c", 0.3)):
        assert counts[name] / n == pytest.approx(phi, abs=0.015)


def test_unhealthy_servers_are_dropped_and_phi_renormalised():
    profile = make_profile("loraserve", rng=random.Random(1))
    candidates = [Candidate("a", phi=0.5, healthy=False), Candidate("b", phi=0.25), Candidate("c", phi=0.25)]
    counts = Counter(profile.pick(SQL, candidates).server_id for _ in range(4000))
    assert set(counts) == {"b", "c"} and abs(counts["b"] - counts["c"]) < 300


def test_assigned_filter_falls_back_to_holders_then_to_everyone():
    f = AssignedFilter()
    holders = [Candidate("a"), Candidate("b", residency=Residency.HOST)]
    assert [c.server_id for c in f.filter(SQL, holders)] == ["b"]
    nobody = [Candidate("a"), Candidate("b")]
    assert f.filter(SQL, nobody) == nobody
    assert f.filter(RouteRequest(None), servers(a=0.0, b=1.0)) == servers(a=0.0, b=1.0)


def test_rank_filter_and_empty_results_name_the_filter():
    profile = make_profile("loraserve")
    with pytest.raises(NoCandidateError) as err:
        profile.pick(RouteRequest("big", rank=128), [Candidate("a", phi=1.0, max_rank=64)])
    assert err.value.reason == "rank"
    with pytest.raises(NoCandidateError) as err:
        profile.pick(SQL, [Candidate("a", phi=1.0, healthy=False)])
    assert err.value.reason == "healthy"
    with pytest.raises(NoCandidateError):
        profile.pick(SQL, [])


def test_queue_scorer_is_min_max_normalised():
    candidates = [Candidate("a", queue_depth=0), Candidate("b", queue_depth=5), Candidate("c", queue_depth=10)]
    assert QueueScorer().score(SQL, candidates) == [1.0, 0.5, 0.0]
    assert QueueScorer().score(SQL, candidates[:1] * 2) == [1.0, 1.0]


def test_load_aware_max_score_prefers_resident_idle_servers():
    profile = make_profile("load-aware", rng=random.Random(0), picker="max-score")
    candidates = [Candidate("busy", phi=0.5, residency=Residency.GPU, queue_depth=9),
                  Candidate("idle", phi=0.5, residency=Residency.GPU, queue_depth=1),
                  Candidate("cold", phi=0.5, residency=Residency.NONE, queue_depth=0)]
    assert profile.pick(SQL, candidates).server_id == "idle"


def test_max_score_breaks_ties_at_random():
    picker, rng = MaxScorePicker(), random.Random(3)
    picks = {picker.pick(servers(a=1, b=1), [1.0, 1.0], rng).server_id for _ in range(50)}
    assert picks == {"a", "b"}


def test_profiles_and_weights_are_checked():
    with pytest.raises(ValueError, match="unknown routing profile"):
        make_profile("nope")
    with pytest.raises(ValueError, match="unknown scorer or picker"):
        make_profile(scorers={"magic": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        make_profile(scorers={"phi": -1.0})
    assert parse_weights("phi=1, queue=0.5,residency") == {"phi": 1.0, "queue": 0.5, "residency": 1.0}
    with pytest.raises(ValueError, match="NAME=NUMBER"):
        parse_weights("phi=x")
