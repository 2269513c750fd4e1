"""Routing tables whose every version is known from its number, for store tests: version v re-digests
a tenth of the adapters (those with i % 10 == v % 10), so a reader can check any version it holds."""

from __future__ import annotations

from loraplex.routing import RoutingTable, make_entry


def digest_at(adapter: int, version: int) -> str:
    """Adapter i's digest at version v: the last version up to v that changed it (0: none did)."""
    return f"sha256:{max(0, version - (version - adapter) % 10)}"


def partial_table(version: int, adapters: int = 200) -> RoutingTable:
    """Version `version`, a tenth of whose entries changed since the version before."""
    entries = {f"a{i}": make_entry(f"a{i}", digest_at(i, version), 8, [(f"s{i % 7}", 1.0)]) for i in range(adapters)}
    return RoutingTable(version, float(version), entries, "test")
