"""The table brought in line with the registry between placements: new adapters at once (on replicas.min
servers), deleted ones gone, every change in one version."""

from __future__ import annotations

import pytest
from loraplex_operator.table_edits import NoServerError, pick_servers, sync_with_registry

from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord, make_entry

D = "sha256:" + "a" * 64


def _server(sid: str, max_rank: int = 64) -> ServerRecord:
    return ServerRecord(sid, f"http://{sid}:8000", max_rank)


def _record(name: str, rank: int = 16, digest: str = D, locations: frozenset[str] = frozenset()) -> AdapterRecord:
    return AdapterRecord(name, digest, rank, 100, "hf://o/a", locations=locations)


def _table(**routes: dict[str, float]) -> RoutingTable:
    entries = {name: make_entry(name, D, 16, w.items()) for name, w in routes.items()}
    return RoutingTable(7, 0.0, entries, "loraserve", 2).validate()


SERVERS = [_server("p-0"), _server("p-1"), _server("p-2", max_rank=8)]


def _registered(table: RoutingTable) -> list[AdapterRecord]:
    return [_record(name) for name in table.entries]


def test_new_adapter_goes_to_the_least_loaded_capable_server() -> None:
    table = _table(a={"p-0": 1.0}, b={"p-0": 0.5, "p-1": 0.5}, c={"p-2": 1.0})
    new = sync_with_registry(table, _registered(table) + [_record("x")], SERVERS, now=5.0)
    assert new.version == 8 and new.policy == "loraserve" and new.required_servers == 2
    assert new.routes("x")[0].server == "p-1"  # p-2 has fewer adapters but max rank 8 < 16
    assert new.entries["a"] == table.entries["a"]


def test_many_new_adapters_spread_in_one_version() -> None:
    table = _table(a={"p-0": 1.0})
    new = sync_with_registry(table, _registered(table) + [_record(f"x{i}") for i in range(4)], SERVERS, now=5.0)
    assert new.version == 8  # one version for the whole batch
    # Each goes to the least loaded capable server as the batch fills them (ties by id).
    assert [new.routes(f"x{i}")[0].server for i in range(4)] == ["p-1", "p-0", "p-1", "p-0"]


def test_first_table_and_held_copy_preferred() -> None:
    new = sync_with_registry(None, [_record("x", locations=frozenset({"p-1"}))], SERVERS, now=1.0)
    assert new.version == 1 and new.routes("x")[0].server == "p-1"


def test_unchanged_registry_needs_no_new_version_and_digest_change_keeps_routes() -> None:
    table = _table(a={"p-0": 0.3, "p-1": 0.7})
    assert sync_with_registry(table, [_record("a")], SERVERS, 1.0) is None
    moved = sync_with_registry(table, [_record("a", digest="sha256:" + "b" * 64)], SERVERS, 1.0)
    assert moved.entries["a"].digest.startswith("sha256:b")
    assert {r.server: r.weight for r in moved.routes("a")} == pytest.approx({"p-0": 0.3, "p-1": 0.7})


def test_no_capable_server() -> None:
    with pytest.raises(NoServerError, match="rank 128"):
        pick_servers(_record("x", rank=128), SERVERS, {})
    assert sync_with_registry(None, [_record("x", rank=128)], SERVERS, 1.0) is None  # waits for a placement
    table = _table(a={"p-0": 1.0})
    raised = sync_with_registry(table, [_record("a", rank=128)], SERVERS, 1.0)
    assert raised is not None and "a" not in raised.entries  # its servers cannot hold the new rank


def test_deleted_adapters_leave_in_one_version() -> None:
    table = _table(a={"p-0": 1.0}, b={"p-1": 1.0}, c={"p-1": 1.0})
    new = sync_with_registry(table, [_record("b")], SERVERS, 2.0)
    assert set(new.entries) == {"b"} and new.version == 8
    assert sync_with_registry(new, [_record("b")], SERVERS, 3.0) is None
    assert sync_with_registry(None, [], SERVERS, 3.0) is None


def test_new_adapter_goes_to_min_copies_of_capable_servers() -> None:
    table = _table(a={"p-0": 1.0}, b={"p-0": 0.5, "p-1": 0.5})
    records = _registered(table) + [_record("x", locations=frozenset({"p-0"}))]
    new = sync_with_registry(table, records, SERVERS + [_server("p-3")], 1.0, copies={"x": 2})
    # p-0 holds a copy (no fetch); then p-3, with fewer adapters than p-1; p-2 cannot hold rank 16.
    assert {r.server: r.weight for r in new.routes("x")} == pytest.approx({"p-0": 0.5, "p-3": 0.5})
    few = sync_with_registry(None, [_record("y")], SERVERS, 1.0, copies={"y": 3})
    assert sorted(r.server for r in few.routes("y")) == ["p-0", "p-1"]  # only two can hold rank 16
