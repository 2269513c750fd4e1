"""Chameleon's pure steps: WRS, K-means with the elbow rule, boundaries and M/M/1 quotas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.scheduling.queue_plan import (
    boundaries,
    choose_k,
    classify,
    kmeans_1d,
    kmeans_path,
    plan_boundaries,
)
from loraplex.engine.scheduling.quotas import QueueLoad, min_quota, plan_quotas
from loraplex.engine.scheduling.wrs import SizeModel

SIZE = SizeModel(max_in=1000, max_out=2000, max_rank=128, block_size=16)


def test_wrs_is_the_papers_degree_two_formula():
    assert SIZE.wrs(500, 1000, 64) == pytest.approx((0.4 * 0.5 + 0.6 * 0.5) * 0.5)
    assert SIZE.wrs(100, 0, 128) == pytest.approx(0.04)
    assert SIZE.wrs(500, 1000, 8) == pytest.approx(SIZE.wrs(500, 1000, 128) / 16)  # rank multiplies
    assert SIZE.wrs(500, 1000, 0) == SIZE.wrs(500, 1000, 8)  # the base model counts as base_rank


def test_need_is_input_plus_output_in_whole_blocks_plus_the_adapter():
    assert SIZE.need_tokens(10, 7, 0) == 32  # 17 tokens -> two blocks of 16
    assert SIZE.need_tokens(16, 16, 32) == 32 + 4 * 32


def test_kmeans_finds_separated_clusters_and_their_wcss():
    fit = kmeans_1d([1, 1, 2, 2, 10, 10, 11, 11], 2)
    assert fit.centroids == [1.5, 10.5]
    assert fit.wcss == pytest.approx(8 * 0.25)
    assert kmeans_1d([1, 2, 3], 1).wcss == pytest.approx(2.0)
    assert kmeans_1d([5, 5, 5], 3).centroids == [5.0]  # no more clusters than distinct values


def test_the_elbow_picks_the_knee_not_the_minimum():
    # two clusters: WCSS drops a lot at K=2 and barely after; minimal WCSS would say 4
    assert choose_k([100.0, 2.0, 1.5, 1.2], elbow_gain=0.1) == 2
    assert choose_k([100.0, 95.0, 90.0, 85.0], elbow_gain=0.1) == 1
    assert choose_k([100.0, 50.0, 25.0, 5.0], elbow_gain=0.1) == 4
    assert choose_k([0.0, 0.0], elbow_gain=0.1) == 1
    values = [0.01] * 50 + [0.02] * 50 + [0.5] * 20
    assert len(plan_boundaries(values, 4, 0.1)) == 1  # 0.01 and 0.02 are one class next to 0.5
    assert len(plan_boundaries([0.01] * 40 + [0.3] * 40 + [0.9] * 40, 4, 0.1)) == 2


def test_boundaries_are_centroid_midpoints_and_a_tie_goes_up():
    assert boundaries([1.0, 3.0, 7.0]) == [2.0, 5.0]
    assert plan_boundaries([1, 1, 1, 3, 3, 3], 4, 0.1) == [2.0]
    assert [classify(x, [2.0, 5.0]) for x in (0.0, 1.99, 2.0, 4.9, 5.0, 100.0)] == [0, 0, 1, 1, 2, 2]


def test_the_quota_floor_is_the_mm1_bound():
    # S = 2000 tokens, D = 10 s, lambda = 2/s, SLO = 5 s -> 2000 * 10 * (0.2 + 2) = 44,000
    assert min_quota(QueueLoad(2000, 10.0, 2.0), slo_s=5.0) == 44_000


def test_the_rest_of_the_pool_is_split_by_weight():
    loads = [QueueLoad(100, 1.0, 1.0), QueueLoad(300, 1.0, 1.0)]  # floors 120 and 360
    plan = plan_quotas(loads, 1000, slo_s=5.0)
    assert plan.minimums == [120, 360] and not plan.overloaded
    assert plan.quotas == [120 + 130, 360 + 390]  # 520 left, in proportion 1:3
    equal = plan_quotas(loads, 1000, slo_s=5.0, split="equal")
    assert equal.quotas == [120 + 260, 360 + 260]


def test_overload_is_flagged_and_the_floors_scaled_to_fit():
    plan = plan_quotas([QueueLoad(1000, 2.0, 5.0), QueueLoad(10, 1.0, 0.0)], 1000, slo_s=5.0)
    assert plan.overloaded and sum(plan.minimums) > 1000
    assert sum(plan.quotas) == 1000 and min(plan.quotas) >= 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.floats(0.0, 30.0), st.floats(0.0, 50.0)), min_size=1, max_size=4),
       st.integers(4, 100_000), st.sampled_from(["min", "equal"]))
def test_quotas_always_share_out_exactly_the_pool(loads, total, split):
    plan = plan_quotas([QueueLoad(*x) for x in loads], total, slo_s=2.0, split=split)
    assert sum(plan.quotas) == total
    assert all(q >= 1 for q in plan.quotas)
    assert plan.overloaded == (sum(plan.minimums) > total)
    if sum(max(1, m) for m in plan.minimums) <= total:  # the one-unit floor of every queue comes first
        assert all(q >= m for q, m in zip(plan.quotas, plan.minimums, strict=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=300), st.integers(1, 4))
def test_plans_are_sorted_bounded_and_wcss_never_grows(values, max_queues):
    bounds = plan_boundaries(values, max_queues, 0.1)
    assert bounds == sorted(bounds) and len(bounds) < max_queues
    assert all(min(values) <= b <= max(values) for b in bounds)
    fits = kmeans_path(values, 4)
    assert all(a.wcss >= b.wcss - 1e-9 for a, b in zip(fits, fits[1:], strict=False))
