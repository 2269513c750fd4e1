"""Routing-table deltas as pure functions: diff, apply in order, encode and decode."""

import random

import pytest

from loraplex.routing import RoutingTable, RoutingTableError, TableEntry, make_entry
from loraplex.routing.choice import RoutingChoice
from loraplex.routing.delta import (
    DeltaGapError,
    TableDelta,
    apply_delta,
    apply_deltas,
    decode_delta,
    diff_tables,
    encode_delta,
)


def _entry(name: str, servers: list[str], digest: str = "sha256:x"):
    return make_entry(name, digest, 8, [(s, 1.0 + i) for i, s in enumerate(servers)])


def _table(version: int, names: range = range(20), **header) -> RoutingTable:
    return RoutingTable(version, float(version), {f"a{i}": _entry(f"a{i}", [f"s{i % 4}"]) for i in names},
                        **header)


def _mutate(table: RoutingTable, rng: random.Random) -> RoutingTable:
    entries = dict(table.entries)
    for name in rng.sample(sorted(entries), 3):
        del entries[name]
    for name in rng.sample(sorted(entries), 3):
        entries[name] = _entry(name, rng.sample([f"s{i}" for i in range(8)], 2), f"sha256:{table.version}")
    for i in range(2):
        name = f"new{table.version}-{i}"
        entries[name] = _entry(name, ["s1"])
    return RoutingTable(table.version + 1, table.created_at + 1, entries, "loraserve", table.version % 3,
                        {"target_util": rng.random()}, RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"}))


def test_a_chain_of_deltas_rebuilds_every_version():
    rng = random.Random(0)
    tables = [_table(1)]
    for _ in range(10):
        tables.append(_mutate(tables[-1], rng))
    deltas = [decode_delta(encode_delta(diff_tables(a, b))) for a, b in zip(tables, tables[1:], strict=False)]
    assert apply_deltas(tables[0], deltas) == tables[-1]
    assert apply_deltas(tables[3], deltas[3:5]) == tables[5]


def test_a_delta_carries_only_what_changed_and_keeps_the_rest_shared():
    old = _table(1)
    new = RoutingTable(2, 2.0, {**old.entries, "a3": _entry("a3", ["s1", "s2"])})
    delta = diff_tables(old, new)
    assert set(delta.table.entries) == {"a3"} and delta.removed == () and delta.count == 20
    applied = apply_delta(old, delta)
    assert applied == new and applied.entries["a0"] is old.entries["a0"]
    assert len(encode_delta(delta)) < 300


def test_removals_and_header_changes_travel():
    old = _table(1, policy="loraserve", required_servers=2)
    new = _table(4, range(5, 20), policy="contiguous", required_servers=7, meta={"u": 0.5},
                 routing=RoutingChoice("least-loaded"))
    delta = decode_delta(encode_delta(diff_tables(old, new)))
    assert delta.removed == tuple(f"a{i}" for i in range(5)) and delta.table.entries == {}
    assert apply_delta(old, delta) == new


@pytest.mark.parametrize("base", [0, 2])
def test_a_delta_on_another_version_is_a_gap(base):
    old, new = _table(1), _table(3, range(19))
    delta = diff_tables(_table(2), new)
    with pytest.raises(DeltaGapError):
        apply_delta(old, delta if base == 2 else TableDelta(base, delta.table, delta.removed, delta.count))


def test_a_delta_that_breaks_the_table_is_rejected():
    old, new = _table(1), _table(2)
    delta = diff_tables(old, new)
    with pytest.raises(RoutingTableError, match="leaves"):
        apply_delta(old, TableDelta(1, delta.table, ("a0",), delta.count))
    half = TableEntry("a0", "sha256:x", 8, ())
    with pytest.raises(RoutingTableError, match="no server"):
        apply_delta(old, TableDelta(1, RoutingTable(2, 0.0, {"a0": half}), (), 20))
    with pytest.raises(RoutingTableError, match="forward"):
        diff_tables(new, old)
    with pytest.raises(RoutingTableError, match="forward"):
        apply_delta(old, TableDelta(1, RoutingTable(1, 0.0, {}), (), 20))


@pytest.mark.parametrize("text", ["not json", "{}", '{"version": 2, "created_at": 0, "base": 1, "count": 1, '
                                  '"removed": [], "set": {"a": {}}}'])
def test_malformed_delta_is_a_table_error(text):
    with pytest.raises(RoutingTableError, match="malformed"):
        decode_delta(text)
