"""The pure parts of `sizing.estimator: planner`: the plan request, its cache key, the runner, and
what an outcome does to the pool status."""

from __future__ import annotations

import pytest
from loraplex_operator.planner_runner import PLAN_FAILED, PLANNER_ERROR, PlannerRunner, PlanOutcome
from loraplex_operator.pool_sizing import planner_sizing
from loraplex_operator.sizing import (
    MIN_RATE_RPS,
    RATE_STEP,
    check_profile,
    plan_key,
    planner_oracle,
    rounded_rate,
    workload_summary,
)
from pydantic import ValidationError

from loraplex.latency.profile import load_profile
from loraplex.placement.snapshot import PlacementAdapter
from loraplex.sim.metrics import Slo
from loraplex.sim.planner import Plan, PlanError
from loraplex.spec.crd import AdapterPoolSpec, AdapterPoolStatus, Condition, SizingSpec

SIZING = SizingSpec(estimator="planner", profile="cpu-tiny", prompt_tokens=256, output_tokens=64)


def _adapter(name: str, rank: int, tps: float) -> PlacementAdapter:
    return PlacementAdapter(name, "sha256:" + "e" * 64, rank, tps)


@pytest.mark.parametrize("rate", [0.0021, 0.5, 1.0, 3.7, 250.0])
def test_rates_round_up_within_one_step(rate: float) -> None:
    rounded = rounded_rate(rate)
    assert rate <= rounded < rate * RATE_STEP + 1e-9
    assert rounded_rate(rounded) == rounded  # grid points stay put: the same demand, the same key


def test_no_demand_gets_the_floor_rate_and_bad_rates_are_refused() -> None:
    assert rounded_rate(0.0) == MIN_RATE_RPS
    with pytest.raises(ValueError, match="finite and >= 0"):
        rounded_rate(-1.0)


def test_summary_turns_tokens_per_second_into_requests_per_second() -> None:
    summary = workload_summary([_adapter("b", 8, 0.0), _adapter("a", 16, 640.0)], SIZING)
    assert summary is not None
    assert [(a.name, a.rank, a.rate_rps) for a in summary.adapters] == [("a", 16, rounded_rate(2.0)),
                                                                        ("b", 8, MIN_RATE_RPS)]
    assert (summary.prompt_len, summary.output_len) == (256.0, 64.0)
    assert workload_summary([], SIZING) is None


def _spec(**changes: object) -> AdapterPoolSpec:
    spec = {"baseModel": {"name": "m", "source": "hf://m"}, "engine": {"maxLoras": 8},
            "sizing": SIZING.model_dump(by_alias=True)}
    return AdapterPoolSpec.model_validate({**spec, **changes})


def test_key_follows_demand_and_settings() -> None:
    summary = workload_summary([_adapter("a", 16, 640.0)], SIZING)
    wobble = workload_summary([_adapter("a", 16, 641.0)], SIZING)
    assert summary is not None and wobble is not None
    assert plan_key(summary, _spec()) == plan_key(wobble, _spec())  # within one rate step
    longer = {**SIZING.model_dump(by_alias=True), "oracleSeconds": 120.0}
    variants = [_spec(), _spec(engine={"maxLoras": 4}), _spec(sizing=longer),
                _spec(placement={"slo": {"ttftP95Seconds": 1.0}}), _spec(placement={"slo": {"tbtP95Seconds": 0.1}})]
    assert len({plan_key(summary, spec) for spec in variants}) == len(variants)


def test_the_planner_holds_servers_to_the_pools_p95_slo() -> None:
    oracle = planner_oracle(load_profile("cpu-tiny"), _spec(placement={"slo": {"ttftP95Seconds": 1.5,
                                                                                "tbtP95Seconds": 0.2}}))
    assert (oracle.slo, oracle.slo_target) == (Slo(1.5, 0.2), 0.95)


def test_lengths_beyond_the_profiles_model_length_are_refused() -> None:
    profile = load_profile("cpu-tiny")
    check_profile(profile, SIZING)
    with pytest.raises(ValueError, match="exceeds the max_model_len 2048 of profile 'cpu-tiny'"):
        check_profile(profile, SIZING.model_copy(update={"prompt_tokens": 2000}))


def test_planner_needs_a_profile(api_server_errors) -> None:  # noqa: ANN001 (fixture)
    with pytest.raises(ValidationError, match="sizing.profile is required"):
        SizingSpec(estimator="planner")
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": "p"},
            "spec": {"baseModel": {"name": "m", "source": "hf://m"}, "sizing": {"estimator": "planner"}}}
    assert api_server_errors(pool) == ["sizing.profile is required when sizing.estimator is planner"]
    pool["spec"]["sizing"]["profile"] = "cpu-tiny"
    assert api_server_errors(pool) == []
    assert AdapterPoolSpec.model_validate({"baseModel": {"name": "m", "source": "hf://m"}}).sizing.estimator \
        == "placement"


def _plan(servers: int) -> Plan:
    return Plan({f"a{i}": i for i in range(servers)}, [8] * servers, [100.0] * servers)


def test_runner_plans_a_workload_once_and_reports_failures() -> None:
    runner = PlannerRunner()
    calls: list[str] = []

    def job(servers: int) -> Plan:
        calls.append("run")
        return _plan(servers)

    try:
        runner.ask("p", "k1", lambda: job(2))
        assert runner.wait(30)
        runner.ask("p", "k1", lambda: job(3))  # cached: not planned again
        outcome = runner.outcome("p")
        assert outcome is not None and (outcome.servers, outcome.slots, outcome.adapters) == (2, (8, 8), 2)
        assert calls == ["run"]

        def starving() -> Plan:
            raise PlanError("adapter x starves a GPU on its own")

        def broken() -> Plan:
            raise KeyError("oops")

        for key, bad, reason in (("k2", starving, PLAN_FAILED), ("k3", broken, PLANNER_ERROR)):
            runner.ask("p", key, bad)
            assert runner.wait(30)
            failed = runner.outcome("p")
            assert failed is not None and (failed.servers, failed.reason) == (None, reason)
        runner.forget("p")
        assert not runner.asked("p") and runner.outcome("p") is None
    finally:
        runner.close()


def _status(required: int | None, slots: list[int], reason: str = "Planned") -> AdapterPoolStatus:
    condition = Condition(type="Planned", status="True" if reason == "Planned" else "False", reason=reason,
                          message="before")
    return AdapterPoolStatus(required_servers=required, planned_adapter_slots=slots, conditions=[condition])


def test_a_new_count_is_announced_once_and_replicas_min_is_a_floor() -> None:
    first = planner_sizing(PlanOutcome("k", 2, (8, 8), 5, 1.5), None, floor=1)
    assert (first.required, first.slots, first.condition[:2]) == (2, (8, 8), (True, "Planned"))
    assert [e.reason for e in first.events] == ["Planned"] and "no -> 2 servers" in first.events[0].message
    same = planner_sizing(PlanOutcome("k", 2, (8, 8), 5, 1.5), _status(2, [8, 8]), floor=1)
    assert same.events == ()
    floored = planner_sizing(PlanOutcome("k", 2, (8, 8), 5, 1.5), _status(2, [8, 8]), floor=3)
    assert floored.required == 3


def test_a_running_plan_keeps_the_last_one() -> None:
    waiting = planner_sizing(None, None, floor=1)
    assert (waiting.required, waiting.condition[:2]) == (None, (False, "Planning"))
    kept = planner_sizing(None, _status(3, [8, 8, 8]), floor=1)
    assert (kept.required, kept.slots, kept.condition) == (3, (8, 8, 8), (True, "Planned", "before"))


def test_a_failed_plan_is_a_condition_that_keeps_the_last_plan() -> None:
    outcome = PlanOutcome("k", None, (), 0, 0.2, PLAN_FAILED, "adapter x starves a GPU on its own")
    failed = planner_sizing(outcome, _status(2, [8, 8]), floor=1)
    assert (failed.required, failed.slots) == (2, (8, 8))
    assert failed.condition == (False, PLAN_FAILED, "adapter x starves a GPU on its own; keeping the last plan "
                                                    "(2 servers)")
    assert [(e.type, e.reason) for e in failed.events] == [("Warning", PLAN_FAILED)]
    again = planner_sizing(outcome, _status(2, [8, 8], reason=PLAN_FAILED), floor=1)
    assert again.events == ()  # announced once
