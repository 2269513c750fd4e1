"""Placement -> status: the phases of a LoRADeployment, the events of each transition, the pool status."""

from __future__ import annotations

from loraplex_operator.adapter_status import AdapterView, adapter_status, beyond_every_server, blocked_status
from loraplex_operator.pool_status import PoolView, placement_due, pool_status, shortfall_condition

from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord, make_entry

D = "sha256:" + "c" * 64
RECORD = AdapterRecord("sql", D, 16, 1000, "hf://o/sql")
TABLE = RoutingTable(3, 0.0, {"sql": make_entry("sql", D, 16, [("p-0", 0.6), ("p-1", 0.4)])}).validate()


def _server(sid: str, host: tuple[str, ...] = (), max_rank: int = 64) -> ServerRecord:
    return ServerRecord(sid, f"http://{sid}:8000", max_rank, host_adapters=host)


def _view(**kw) -> AdapterView:
    base = dict(name="sql", pool="p", generation=2, pool_exists=True, record=RECORD, table=TABLE,
                servers=[_server("p-0"), _server("p-1")])
    return AdapterView(**{**base, **kw})


def test_phases_follow_the_world() -> None:
    cases = [
        (dict(pool_exists=False, record=None), "Pending", "PoolNotFound"),
        (dict(record=None), "Pending", "NotRegistered"),
        (dict(table=None, servers=[]), "Pending", "NoServers"),
        (dict(table=None), "Pending", "AwaitingPlacement"),
        ({}, "Loading", "Fetching"),
        (dict(servers=[_server("p-0", ("sql",)), _server("p-1")]), "Ready", "Serving"),
    ]
    for changes, phase, reason in cases:
        status, _ = adapter_status(_view(**changes), None, now=0)
        assert (status.phase, status.reason) == (phase, reason), changes


def test_ready_status_shows_rank_digest_weights_and_demand() -> None:
    view = _view(servers=[_server("p-0", ("sql",)), _server("p-1", ("sql",))], demand_tps=12.5, demand_window_s=60)
    status, events = adapter_status(view, None, now=0)
    assert status.rank == 16 and status.digest == D and status.ready_servers == 2
    assert status.weights == "p-0=0.60,p-1=0.40"
    assert status.observed_demand.tokens_per_second == 12.5
    assert {c.type: c.status for c in status.conditions} == {"Registered": "True", "Placed": "True", "Ready": "True"}
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "Serving", "Ready: served by 2 of 2 assigned servers (p-0=0.60,p-1=0.40)")]


def test_events_only_on_transitions_and_transition_times_kept() -> None:
    loading, _ = adapter_status(_view(), None, now=100)
    again, events = adapter_status(_view(), loading, now=200)
    assert events == [] and again == loading
    ready, events = adapter_status(_view(servers=[_server("p-0", ("sql",)), _server("p-1")]), loading, now=300)
    assert [e.reason for e in events] == ["Serving"]
    times = {c.type: c.last_transition_time for c in ready.conditions}
    assert times["Placed"] == "1970-01-01T00:01:40Z" and times["Ready"] == "1970-01-01T00:05:00Z"


def test_failed_is_a_warning() -> None:
    status, events = blocked_status("Failed", "RankTooLarge", "rank 128 exceeds 64", 1, None, 0)
    assert status.phase == "Failed" and events[0].type == "Warning" and events[0].reason == "RankTooLarge"


def test_unplaceable_adapter_fails_with_the_ranks_and_recovers_when_placed() -> None:
    small = [_server("p-0", max_rank=8), _server("p-1", max_rank=8)]
    failed, events = adapter_status(_view(table=None, servers=small, unplaceable=True), None, now=0)
    assert (failed.phase, failed.reason) == ("Failed", "RankExceedsServers")
    assert failed.message.startswith("rank 16 exceeds every server's maxLoraRank (at most 8)")
    assert [(e.type, e.reason) for e in events] == [("Warning", "RankExceedsServers")]
    placed, events = adapter_status(_view(unplaceable=False), failed, now=60)
    assert placed.phase == "Loading" and [e.reason for e in events] == ["Fetching"]
    # Without servers the adapter waits for them rather than failing.
    assert adapter_status(_view(table=None, servers=[], unplaceable=True), None, 0)[0].reason == "NoServers"


def test_beyond_every_server() -> None:
    assert beyond_every_server(16, [_server("a", max_rank=8)])
    assert not beyond_every_server(16, [_server("a", max_rank=8), _server("b", max_rank=16)])
    assert not beyond_every_server(16, [])


def test_capacity_shortfall_condition() -> None:
    def view(overloaded: tuple[str, ...], load: float | None, required: int = 4, max_replicas: int | None = 4
             ) -> PoolView:
        return PoolView("p", 1, 3, 3, TABLE, [], required, "", overloaded, load, max_replicas)

    assert shortfall_condition(view((), None)) == (False, "EnoughCapacity", "")
    ok, reason, message = shortfall_condition(view(("p-0",), 0.8))
    assert (ok, reason) == (False, "Unbalanced") and "busiest at 0.80" in message
    ok, reason, message = shortfall_condition(view(("p-0", "p-2"), 1.6))
    assert (ok, reason) == (True, "ServersOverloaded") and message.startswith("servers p-0, p-2 are overloaded")
    assert shortfall_condition(view(("p-0",), 1.6, required=5))[1] == "AtMaxReplicas"
    assert shortfall_condition(view(("p-0",), 1.6, required=5, max_replicas=None))[1] == "ServersOverloaded"
    status = pool_status(view(("p-0",), 1.6), None, 0.0, None, 1.0)
    assert status.overloaded_servers == ["p-0"] and status.max_server_load == 1.6
    assert {c.type: c.status for c in status.conditions}["CapacityShortfall"] == "True"


def test_pool_status() -> None:
    view = PoolView("p", 4, replicas=3, ready_replicas=2, table=TABLE, servers=[_server("p-0"), _server("p-1")],
                    required_servers=2)
    status = pool_status(view, None, last_placement=60.0, below_since=None, now=61.0)
    assert (status.phase, status.replicas, status.ready_replicas, status.routing_version) == ("Progressing", 3, 2, 3)
    assert status.selector == "app.kubernetes.io/component=agent,loraplex.io/pool=p"
    assert [(s.name, s.ready, s.adapters, s.weight) for s in status.servers] == [
        ("p-0", True, 1, 0.6), ("p-1", True, 1, 0.4), ("p-2", False, 0, 0.0)]
    assert status.last_placement_time == "1970-01-01T00:01:00Z" and status.required_servers == 2
    degraded = pool_status(PoolView("p", 4, 3, 3, None, [], None, "redis down"), status, None, None, 62.0)
    assert degraded.phase == "Degraded"


def test_placement_due() -> None:
    assert placement_due(None, 60, 0)
    assert not placement_due("1970-01-01T00:01:00Z", 60, 119)
    assert placement_due("1970-01-01T00:01:00Z", 60, 120)


def test_an_activated_lora_is_unservable_on_the_vllm_backend_only() -> None:
    from loraplex_operator.adapter_reconcile import alora_unservable

    from loraplex.spec.crd import AdapterPoolSpec

    def pool(backend: str) -> AdapterPoolSpec:
        return AdapterPoolSpec.model_validate({"baseModel": {"name": "tiny", "source": "file:///m"},
                                               "engine": {"backend": backend, "maxLoraRank": 64}})

    alora = AdapterRecord("c", "sha256:" + "0" * 64, 8, 1, "file:///c", invocation_tokens=(5, 6))
    standard = AdapterRecord("s", "sha256:" + "0" * 64, 8, 1, "file:///s")
    assert "activated LoRA" in alora_unservable(alora, pool("vllm"))
    assert alora_unservable(alora, pool("loraplex")) is None
    assert alora_unservable(standard, pool("vllm")) is None
