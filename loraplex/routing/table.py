"""The routing table: for every adapter, the servers that serve it and the fraction φ of its traffic
each one gets (LoRAServe's (adapter, server, φ) tuples). Versions are immutable; a new placement is
a new version."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loraplex.routing.choice import RoutingChoice
from loraplex.spec.adapter import validate_adapter_name

PHI_TOLERANCE = 1e-6


class RoutingTableError(ValueError):
    """A table that breaks an invariant (Σφ ≠ 1, no server, bad weight); it must never be published."""


@dataclass(frozen=True)
class Route:
    """One (server, φ) pair: the server gets this fraction of the adapter's requests."""

    server: str
    weight: float


@dataclass(frozen=True)
class TableEntry:
    """Where one adapter is served. `digest` and `rank` travel with the routes so the router and the
    agents need no second lookup to know which weights a server must hold."""

    adapter: str
    digest: str
    rank: int
    routes: tuple[Route, ...]

    def validate(self) -> None:
        validate_adapter_name(self.adapter)
        if self.rank <= 0:
            raise RoutingTableError(f"adapter {self.adapter!r}: rank must be positive, got {self.rank}")
        if not self.routes:
            raise RoutingTableError(f"adapter {self.adapter!r} has no server")
        servers = [r.server for r in self.routes]
        if len(set(servers)) != len(servers):
            raise RoutingTableError(f"adapter {self.adapter!r} lists a server twice: {servers}")
        for route in self.routes:
            if not route.server:
                raise RoutingTableError(f"adapter {self.adapter!r} has an empty server id")
            if not (math.isfinite(route.weight) and 0.0 < route.weight <= 1.0 + PHI_TOLERANCE):
                raise RoutingTableError(f"adapter {self.adapter!r}: weight {route.weight} on {route.server!r} "
                                        "is not in (0, 1]")
        total = sum(r.weight for r in self.routes)
        if abs(total - 1.0) > PHI_TOLERANCE:
            raise RoutingTableError(f"adapter {self.adapter!r}: weights sum to {total}, not 1")

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(r.server for r in self.routes)


@dataclass(frozen=True)
class RoutingTable:
    """One published placement. `required_servers` is the placement's estimate of the servers the
    forecast demand needs (the operator's autoscaling signal); `policy` names who produced it.
    `routing` is the pool's routing profile for the routers; None: each router's flags decide."""

    version: int
    created_at: float
    entries: Mapping[str, TableEntry]
    policy: str = ""
    required_servers: int = 0
    meta: Mapping[str, float] = field(default_factory=dict)
    routing: RoutingChoice | None = None

    def validate(self) -> RoutingTable:
        if self.version <= 0:
            raise RoutingTableError(f"table version must be positive, got {self.version}")
        for name, entry in self.entries.items():
            if name != entry.adapter:
                raise RoutingTableError(f"table key {name!r} holds the entry of {entry.adapter!r}")
            entry.validate()
        return self

    def routes(self, adapter: str) -> tuple[Route, ...]:
        entry = self.entries.get(adapter)
        return entry.routes if entry else ()

    def servers(self) -> set[str]:
        return {r.server for e in self.entries.values() for r in e.routes}

    def assignments(self, server: str) -> dict[str, float]:
        """UPDATEADAPTERMAPPING: the adapters assigned to one server, with their φ there."""
        return {e.adapter: r.weight for e in self.entries.values() for r in e.routes if r.server == server}

    def same_routes(self, other: RoutingTable | None, tolerance: float = PHI_TOLERANCE) -> bool:
        """True when `other` routes every adapter to the same servers with the same φ (within tolerance)
        and names the same digests: publishing would change nothing for the router or the agents."""
        if other is None or self.entries.keys() != other.entries.keys():
            return False
        return all(_same_entry(e, other.entries[name], tolerance) for name, e in self.entries.items())


def _same_entry(a: TableEntry, b: TableEntry, tolerance: float) -> bool:
    if (a.digest, a.rank) != (b.digest, b.rank):
        return False
    wa = {r.server: r.weight for r in a.routes}
    wb = {r.server: r.weight for r in b.routes}
    return wa.keys() == wb.keys() and all(abs(wa[s] - wb[s]) <= tolerance for s in wa)


def make_entry(adapter: str, digest: str, rank: int, weights: Iterable[tuple[str, float]]) -> TableEntry:
    """Builds an entry, normalising φ so it sums to exactly 1 (placement arithmetic leaves 1e-15 dust)."""
    pairs = [(s, w) for s, w in weights if w > 0.0]
    total = sum(w for _, w in pairs)
    if total <= 0.0:
        raise RoutingTableError(f"adapter {adapter!r} has no server with positive weight")
    return TableEntry(adapter, digest, rank, tuple(Route(s, w / total) for s, w in sorted(pairs)))


def encode_table(table: RoutingTable) -> str:
    """The JSON of a whole table (the snapshot). Compact: 10,000 adapters are about 1.5 MB."""
    doc = encode_header(table)
    doc["adapters"] = {name: encode_entry(e) for name, e in table.entries.items()}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def decode_table(text: str | bytes) -> RoutingTable:
    """Parses and validates a stored table; raises RoutingTableError on anything malformed."""
    try:
        doc = json.loads(text)
        entries = {name: decode_entry(name, a) for name, a in doc["adapters"].items()}
        table = decode_header(doc, entries)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RoutingTableError(f"malformed routing table: {exc}") from exc
    return table.validate()


def encode_header(table: RoutingTable) -> dict:
    """Everything of a table but its entries, as a JSON-ready dict (a whole table and a delta carry it)."""
    doc = {"version": table.version, "created_at": table.created_at, "policy": table.policy,
           "required_servers": table.required_servers, "meta": dict(table.meta)}
    if table.routing is not None:  # absent, not null: routers older than the field read the table as before
        doc["routing"] = {"profile": table.routing.profile, "options": dict(table.routing.options)}
    return doc


def decode_header(doc: dict, entries: Mapping[str, TableEntry]) -> RoutingTable:
    """The table `doc`'s header describes, holding `entries` (not validated here); raises what a
    malformed doc raises (KeyError, ValueError, TypeError, AttributeError)."""
    return RoutingTable(int(doc["version"]), float(doc["created_at"]), entries, str(doc.get("policy", "")),
                        int(doc.get("required_servers", 0)),
                        {str(k): float(v) for k, v in doc.get("meta", {}).items()},
                        _decode_routing(doc.get("routing")))


def encode_entry(entry: TableEntry) -> dict:
    return {"digest": entry.digest, "rank": entry.rank, "routes": [[r.server, r.weight] for r in entry.routes]}


def decode_entry(name: str, doc: dict) -> TableEntry:
    """The entry of adapter `name` (not validated here); raises what a malformed doc raises."""
    return TableEntry(name, str(doc["digest"]), int(doc["rank"]), tuple(Route(str(s), float(w)) for s, w in doc["routes"]))


def _decode_routing(doc: dict | None) -> RoutingChoice | None:
    """The table's routing choice; None in tables written before the field existed."""
    if doc is None:
        return None
    return RoutingChoice(str(doc["profile"]), {str(k): str(v) for k, v in doc.get("options", {}).items()})
