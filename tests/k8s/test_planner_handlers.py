"""`sizing.estimator: planner` through the real kopf timer handler: the plan runs in the operator's
planner thread with the real twin oracle (cpu-tiny profile, 5 simulated seconds per twin run), and
the tick after it finishes sizes the pool."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from loraplex_operator import pool_sizing
from loraplex_operator.handlers import adapter_changed
from loraplex_operator.sizing import rounded_rate
from operator_world import NS, World

from loraplex.latency.profile import load_profile
from loraplex.routing.demand import DEFAULT_WINDOW_S, bucket_of
from loraplex.sim.metrics import Slo
from loraplex.sim.planner import AdapterDemand, Plan, TwinOracle, WorkloadSummary, plan

SIZING = {"estimator": "planner", "profile": "cpu-tiny", "oracleSeconds": 5, "promptTokens": 256, "outputTokens": 64}
POOL = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
        "servers": {"minReplicas": 1, "maxReplicas": 4, "gpusPerServer": 0},
        "engine": {"maxLoraRank": 64, "maxLoras": 8},
        "placement": {"intervalSeconds": 30, "scaleDownDelaySeconds": 60}, "sizing": SIZING}
TOKENS = 256 + 64
PLAN_TIMEOUT_S = 120  # a bound against a hung worker, not a timing claim


@pytest.fixture
def world() -> Iterator[World]:
    w = World("http://127.0.0.1:9")  # declared s3 adapters: nothing is downloaded
    yield w
    w.deps.close()


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[WorkloadSummary]:
    """Counts the real planner's runs (the workloads it was given)."""
    seen: list[WorkloadSummary] = []

    def counted(summary: WorkloadSummary, *args: Any, **kwargs: Any) -> Plan:
        seen.append(summary)
        return plan(summary, *args, **kwargs)

    monkeypatch.setattr(pool_sizing, "plan", counted)
    return seen


def _pool(world: World, **sizing: Any) -> None:
    spec = copy.deepcopy(POOL)
    spec["sizing"] = {**SIZING, **sizing}
    world.create("AdapterPool", "tiny", spec, "pool-uid")


def _adapters(world: World, tps: float, count: int = 4, rank: int = 16) -> None:
    for i in range(count):
        spec = {"pool": "tiny", "adapter": {"source": f"s3://b/a{i}", "sha256": "e" * 64, "rank": rank},
                "traffic": {"expectedTokensPerSecond": tps}}
        world.create("LoRADeployment", f"a{i}", spec, f"a{i}-uid")
        world.call(adapter_changed, "LoRADeployment", f"a{i}")


def _tick_after_plan(world: World, advance: float = 5) -> dict[str, Any]:
    assert world.deps.planner.wait(PLAN_TIMEOUT_S)
    world.clock.advance(advance)
    world.tick("tiny")
    return world.status("AdapterPool", "tiny")


def _condition(status: dict[str, Any], type_: str = "Planned") -> tuple[str, str, str]:
    c = {c["type"]: c for c in status["conditions"]}[type_]
    return c["status"], c["reason"], c["message"]


def _direct_plan(tps: float, count: int = 4, rank: int = 16) -> Plan:
    """What `loraplex sim plan` would answer for the same workload."""
    profile = load_profile("cpu-tiny")
    demand = tuple(AdapterDemand(f"a{i}", rank, rounded_rate(tps / TOKENS)) for i in range(count))
    oracle = TwinOracle(profile, 5.0, slo=Slo(2.0), slo_target=0.95)  # the pool's default SLO: P95 TTFT 2 s
    return plan(WorkloadSummary(demand, 256.0, 64.0), profile, oracle, max_slots=8)


def test_the_plan_sizes_the_pool_and_an_unchanged_demand_is_not_planned_again(
        world: World, plans: list[WorkloadSummary]) -> None:
    _pool(world)
    _adapters(world, tps=5 * TOKENS)  # 5 requests/s each: more than one CPU server sustains
    world.tick("tiny")  # no server is up yet: the planner sizes the pool from demand alone
    pool = world.status("AdapterPool", "tiny")
    assert _condition(pool)[:2] == ("False", "Planning") and pool["replicas"] == 1

    pool = _tick_after_plan(world)
    expected = _direct_plan(5 * TOKENS)
    assert expected.num_gpus > 1
    assert (pool["requiredServers"], pool["plannedAdapterSlots"]) == (expected.num_gpus, expected.a_max)
    assert pool["replicas"] == expected.num_gpus
    assert world.kube.objects[("AdapterPool", NS, "tiny")]["spec"]["servers"]["replicas"] == expected.num_gpus
    status, reason, message = _condition(pool)
    assert (status, reason) == ("True", "Planned") and message.startswith(f"{expected.num_gpus} servers for 4 adapters")
    assert world.events.reasons("tiny") == ["Planned", "ScaleUp"]

    _tick_after_plan(world, advance=30)  # the next placement: same demand, same key
    assert len(plans) == 1
    assert world.events.reasons("tiny") == ["Planned", "ScaleUp"]


Observe = Callable[[float], None]


@pytest.fixture
def observe(world: World) -> Observe:
    """The router's counters: `tps` per adapter (4 adapters) in each window of the last 70 s not yet counted."""
    filled: set[int] = set()

    def count(tps: float) -> None:
        store, now = world.stores["tiny"], world.clock.now()
        for window in range(bucket_of(now - 70, DEFAULT_WINDOW_S), bucket_of(now, DEFAULT_WINDOW_S)):
            if window not in filled:
                filled.add(window)
                store.add_demand({f"a{i}": int(tps * DEFAULT_WINDOW_S) for i in range(4)}, window * DEFAULT_WINDOW_S)
    return count


def _next_placement(world: World, observe: Observe, tps: float) -> dict[str, Any]:
    """The next placement with `tps` observed per adapter, and the tick that reads its plan."""
    world.clock.advance(30)
    observe(tps)
    world.tick("tiny")
    return _tick_after_plan(world)


def test_observed_demand_is_replanned_and_scales_down_after_the_delay(
        world: World, plans: list[WorkloadSummary], observe: Observe) -> None:
    _pool(world)
    _adapters(world, tps=5 * TOKENS)
    world.tick("tiny")
    high = _tick_after_plan(world)["requiredServers"]
    pool = _next_placement(world, observe, tps=0.5 * TOKENS)  # traffic fell to a tenth
    assert len(plans) == 2 and plans[1].adapters[0].rate_rps == pytest.approx(0.5, rel=0.05)
    assert pool["requiredServers"] == 1 < high and pool["replicas"] == high  # the scale-down delay holds
    assert world.events.reasons("tiny")[-1] == "Planned"
    for _ in range(2):
        pool = _next_placement(world, observe, tps=0.5 * TOKENS)
    assert len(plans) == 2  # the same demand: answered from the cache
    assert pool["replicas"] == 1 and world.events.reasons("tiny")[-1] == "ScaleDown"


def test_an_adapter_that_starves_a_server_alone_is_planned_on_several(world: World) -> None:
    _pool(world)
    _adapters(world, tps=40 * TOKENS, count=1)
    world.tick("tiny")
    pool = _tick_after_plan(world)
    assert _condition(pool)[:2] == ("True", "Planned")
    assert pool["requiredServers"] == _direct_plan(40 * TOKENS, count=1).num_gpus >= 2


def test_an_adapter_that_no_share_of_a_server_can_hold_is_a_condition(world: World) -> None:
    _pool(world)
    _adapters(world, tps=5000 * TOKENS, count=1)  # 1/64 of it still starves a server
    world.tick("tiny")
    pool = _tick_after_plan(world)
    status, reason, message = _condition(pool)
    assert (status, reason) == ("False", "PlanFailed")
    assert "does not fit a GPU even with 1/64 of its requests" in message
    assert message.endswith("servers stay as they are")
    assert "requiredServers" not in pool and pool["replicas"] == 1 and pool["phase"] != "Failed"
    _tick_after_plan(world)
    assert [(e.type, e.reason) for n, e in world.events.posted if n == "tiny"] == [("Warning", "PlanFailed")]


@pytest.mark.parametrize("sizing, fragment", [
    ({"profile": "no-such-profile"}, "profile 'no-such-profile' not found"),
    ({"promptTokens": 4000}, "exceeds the max_model_len 2048 of profile 'cpu-tiny'"),
])
def test_unusable_sizing_fails_the_pool_with_the_reason(world: World, sizing: dict[str, Any], fragment: str) -> None:
    _pool(world, **sizing)
    _adapters(world, tps=TOKENS)
    for _ in range(2):
        world.clock.advance(5)
        world.tick("tiny")
    pool = world.status("AdapterPool", "tiny")
    ready = _condition(pool, "Ready")
    assert pool["phase"] == "Failed" and ready[:2] == ("False", "InvalidSizing") and fragment in ready[2]
    assert _condition(pool)[1] == "InvalidSizing"
    assert world.events.reasons("tiny") == ["InvalidSizing"]  # once, not at every tick

    _pool(world)  # the user fixes the spec: the next tick plans
    world.kube.objects[("AdapterPool", NS, "tiny")]["status"] = pool
    world.tick("tiny")
    pool = _tick_after_plan(world)
    assert pool["phase"] != "Failed" and _condition(pool)[:2] == ("True", "Planned")


def test_placement_estimator_has_no_planner_status(world: World, plans: list[WorkloadSummary]) -> None:
    spec = copy.deepcopy(POOL)
    del spec["sizing"]
    world.create("AdapterPool", "tiny", spec, "pool-uid")
    _adapters(world, tps=TOKENS)
    world.tick("tiny")
    pool = world.status("AdapterPool", "tiny")
    assert "Planned" not in {c["type"] for c in pool["conditions"]} and pool["plannedAdapterSlots"] == []
    assert plans == [] and not world.deps.planner.asked("tiny")


def test_no_adapters_no_plan_until_one_arrives(world: World, plans: list[WorkloadSummary]) -> None:
    _pool(world)
    world.tick("tiny")
    pool = world.status("AdapterPool", "tiny")
    assert _condition(pool)[:2] == ("False", "NoAdapters") and "requiredServers" not in pool and plans == []
    _adapters(world, tps=TOKENS, count=1)
    world.clock.advance(5)
    world.tick("tiny")  # not a placement yet, but no plan was asked: ask now
    pool = _tick_after_plan(world)
    assert _condition(pool)[:2] == ("True", "Planned") and pool["requiredServers"] == 1 and len(plans) == 1
