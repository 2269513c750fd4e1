"""The autoscaling decision."""

from __future__ import annotations

import pytest
from loraplex_operator.scaling import decide_replicas


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
