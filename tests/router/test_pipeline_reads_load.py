"""Which routing profiles read live server state, and score clamping."""

from __future__ import annotations

import math

from loraplex.routing.pipeline import Candidate, PhiScorer, RouteRequest, clamp_unit, make_profile


def test_only_profiles_with_load_scorers_read_load():
    assert not make_profile("loraserve").reads_load
    assert make_profile("load-aware").reads_load
    assert make_profile("loraserve", scorers={"phi": 1.0, "queue": 0.0}).reads_load


def test_scores_are_clamped_into_the_unit_interval():
    in_range = [0.0, 0.5, 1.0]
    assert clamp_unit(in_range) is in_range
    assert clamp_unit([-0.5, 0.25, 1.5]) == [0.0, 0.25, 1.0]
    assert clamp_unit([]) == []
    assert math.isnan(clamp_unit([0.5, math.nan])[1]) and math.isnan(clamp_unit([math.nan, 2.0])[0])
    phis = PhiScorer().score(RouteRequest("a"), [Candidate("x", phi=1.2), Candidate("y", phi=-0.1)])
    assert phis == [1.0, 0.0]
