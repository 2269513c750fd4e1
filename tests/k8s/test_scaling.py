"""The autoscaling decision."""

from __future__ import annotations

import pytest
from loraplex_operator.scaling import decide_replicas, short_of_capacity, with_shortfall


def test_scale_up_is_immediate_and_bounded() -> None:
    d = decide_replicas(2, 5, 1, 4, None, now=100, delay=300)
    assert (d.replicas, d.reason, d.below_since) == (4, "ScaleUp", None)


def test_scale_down_waits_for_the_delay() -> None:
    first = decide_replicas(4, 2, 1, 8, None, now=100, delay=300)
    assert (first.replicas, first.below_since) == (4, 100)
    waiting = decide_replicas(4, 2, 1, 8, first.below_since, now=399, delay=300)
    assert (waiting.replicas, waiting.below_since) == (4, 100)
    done = decide_replicas(4, 2, 1, 8, waiting.below_since, now=400, delay=300)
    assert (done.replicas, done.reason, done.below_since) == (2, "ScaleDown", None)


def test_a_rise_resets_the_scale_down_clock() -> None:
    d = decide_replicas(4, 4, 1, 8, below_since=100, now=200, delay=300)
    assert (d.replicas, d.below_since) == (4, None)


def test_min_replicas_floor_and_no_estimate() -> None:
    assert decide_replicas(3, 0, 2, 8, 0, now=1000, delay=0).replicas == 2
    assert decide_replicas(9, None, 1, 4, None, 0, 0).replicas == 4  # bounds moved under the spec
    with pytest.raises(ValueError):
        decide_replicas(1, 1, 5, 2, None, 0, 0)


def test_shortfall_needs_overload_beyond_one_servers_capacity() -> None:
    assert short_of_capacity(("s0",), 1.6)
    assert not short_of_capacity(("s0",), 0.8)  # above the balanced share only: an imbalance
    assert not short_of_capacity((), 5.0)       # no overload: the estimate alone speaks
    assert not short_of_capacity(("s0",), None)


def test_shortfall_asks_for_one_server_more_than_the_healthy_ones() -> None:
    assert with_shortfall(2, True, healthy_servers=3) == 4
    assert with_shortfall(6, True, healthy_servers=3) == 6
    assert with_shortfall(None, True, healthy_servers=0) == 1
    assert with_shortfall(2, False, healthy_servers=3) == 2
    # Bounded like any estimate: never past maxReplicas.
    assert decide_replicas(4, with_shortfall(2, True, 4), 1, 4, None, now=0, delay=300).replicas == 4
