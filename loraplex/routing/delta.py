"""Routing-table deltas: what changed from one version to the next. The writer publishes a delta per
version over a whole snapshot; a reader holding version v applies the deltas after v, in order, and
reads the snapshot only when the chain from its version has a gap. Pure: diff, apply, encode, decode."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from loraplex.routing.table import (
    RoutingTable,
    RoutingTableError,
    TableEntry,
    decode_entry,
    decode_header,
    encode_entry,
    encode_header,
)


class DeltaGapError(RoutingTableError):
    """A delta (or a chain of them) does not start from the table it is applied to: read the snapshot."""


@dataclass(frozen=True)
class TableDelta:
    """Version `table.version` as a change of version `base`: `table` holds the new header (version,
    created_at, policy, ...) and, as entries, only the adapters added or changed; `removed` names
    the adapters dropped. `count` is the number of adapters after the change (a reader's check)."""

    base: int
    table: RoutingTable
    removed: tuple[str, ...]
    count: int

    @property
    def version(self) -> int:
        return self.table.version


def diff_tables(old: RoutingTable, new: RoutingTable) -> TableDelta:
    """The delta that turns `old` into `new` (entries compared by value)."""
    if new.version <= old.version:
        raise RoutingTableError(f"a delta goes forward: version {new.version} after {old.version}")
    changed = {name: e for name, e in new.entries.items() if old.entries.get(name) != e}
    removed = tuple(sorted(name for name in old.entries if name not in new.entries))
    return TableDelta(old.version, replace(new, entries=changed), removed, len(new.entries))


def validate_delta(delta: TableDelta) -> TableDelta:
    """Checks what a delta brings (its header and the entries it sets) as RoutingTable.validate checks
    a whole table; the entries it leaves alone were checked when their table was."""
    if delta.version <= delta.base:
        raise RoutingTableError(f"delta {delta.base}->{delta.version} does not go forward")
    RoutingTable(delta.version, delta.table.created_at, delta.table.entries).validate()
    return delta


def apply_delta(table: RoutingTable, delta: TableDelta) -> RoutingTable:
    """The table `delta` makes of `table`, validated where it changed (validate_delta). Unchanged
    entries are the same objects in both. Raises DeltaGapError when the delta is not based on
    `table`'s version, RoutingTableError when the result is not valid."""
    validate_delta(delta)
    if delta.base != table.version:
        raise DeltaGapError(f"delta {delta.base}->{delta.version} does not apply to version {table.version}")
    entries = dict(table.entries)
    for name in delta.removed:
        entries.pop(name, None)
    entries.update(delta.table.entries)
    if len(entries) != delta.count:
        raise RoutingTableError(f"delta {delta.base}->{delta.version} leaves {len(entries)} adapters, "
                                f"its writer had {delta.count}")
    return replace(delta.table, entries=entries)


def apply_deltas(table: RoutingTable, deltas: Iterable[TableDelta]) -> RoutingTable:
    """`table` with each delta applied in order (see apply_delta)."""
    for delta in deltas:
        table = apply_delta(table, delta)
    return table


def encode_delta(delta: TableDelta) -> str:
    """The JSON of a delta: the new table's header, `base`, `count`, `set` (added or changed
    entries, as in a whole table) and `removed`."""
    doc = encode_header(delta.table)
    doc.update(base=delta.base, count=delta.count, removed=list(delta.removed),
               set={name: encode_entry(e) for name, e in delta.table.entries.items()})
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def decode_delta(text: str | bytes) -> TableDelta:
    """Parses a stored delta; raises RoutingTableError on anything malformed (validation happens
    when it is applied)."""
    try:
        doc = json.loads(text)
        entries: Mapping[str, TableEntry] = {name: decode_entry(name, e) for name, e in doc["set"].items()}
        return TableDelta(int(doc["base"]), decode_header(doc, entries), tuple(str(n) for n in doc["removed"]),
                          int(doc["count"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RoutingTableError(f"malformed routing table delta: {exc}") from exc
