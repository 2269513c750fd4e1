import pytest

from loraplex.routing import (
    Route,
    RoutingTable,
    RoutingTableError,
    TableEntry,
    decode_table,
    encode_table,
    make_entry,
)


def _table(version: int = 1) -> RoutingTable:
    entries = {"a": make_entry("a", "sha256:aa", 8, [("s1", 3.0), ("s2", 1.0)]),
               "b": make_entry("b", "sha256:bb", 64, [("s2", 1.0)])}
    return RoutingTable(version, 12.5, entries, "loraserve", 2, {"target_util": 0.5})


def test_make_entry_normalises_and_sorts():
    entry = _table().entries["a"]
    assert entry.routes == (Route("s1", 0.75), Route("s2", 0.25))


def test_encode_decode_round_trip():
    table = _table()
    assert decode_table(encode_table(table)) == table


def test_assignments_and_servers():
    table = _table()
    assert table.servers() == {"s1", "s2"}
    assert table.assignments("s2") == {"a": 0.25, "b": 1.0}
    assert table.routes("missing") == ()


@pytest.mark.parametrize("routes, message", [
    ((), "no server"),
    ((Route("s1", 0.5),), "sum to"),
    ((Route("s1", 0.5), Route("s1", 0.5)), "twice"),
    ((Route("s1", 1.5), Route("s2", -0.5)), "not in"),
    ((Route("", 1.0),), "empty server"),
])
def test_invalid_entries_are_rejected(routes, message):
    table = RoutingTable(1, 0.0, {"a": TableEntry("a", "sha256:aa", 8, routes)})
    with pytest.raises(RoutingTableError, match=message):
        table.validate()


def test_version_and_key_mismatch_rejected():
    entry = make_entry("a", "sha256:aa", 8, [("s1", 1.0)])
    with pytest.raises(RoutingTableError, match="positive"):
        RoutingTable(0, 0.0, {"a": entry}).validate()
    with pytest.raises(RoutingTableError, match="holds the entry"):
        RoutingTable(1, 0.0, {"b": entry}).validate()


@pytest.mark.parametrize("text", ["not json", "{}", '{"version": 1, "created_at": 0, "adapters": {"a": {}}}'])
def test_malformed_json_is_a_table_error(text):
    with pytest.raises(RoutingTableError, match="malformed"):
        decode_table(text)


def test_same_routes_uses_tolerance_and_digests():
    table = _table()
    nudged = RoutingTable(2, 0.0, {**table.entries, "a": make_entry("a", "sha256:aa", 8, [("s1", 0.7501), ("s2", 0.2499)])})
    assert nudged.same_routes(table, tolerance=1e-3)
    assert not nudged.same_routes(table, tolerance=1e-6)
    redigested = RoutingTable(2, 0.0, {**table.entries, "b": make_entry("b", "sha256:cc", 64, [("s2", 1.0)])})
    assert not redigested.same_routes(table)
    assert not table.same_routes(None)
