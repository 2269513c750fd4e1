"""The Redis key layout of one pool. Every key starts with `loraplex:{<pool>}:`; the braces are a
Redis Cluster hash tag, so all keys of a pool live in one slot and one MULTI/EXEC can touch them."""

from __future__ import annotations

from dataclasses import dataclass

# The one rule for pool names (DNS-1035 label, at most 52 characters), shared with the CRD.
from loraplex.spec.names import validate_pool_name


@dataclass(frozen=True)
class PoolKeys:
    """Key names for one pool (see docs/cluster.md for the value formats)."""

    pool: str

    def __post_init__(self) -> None:
        validate_pool_name(self.pool)

    @property
    def prefix(self) -> str:
        return f"loraplex:{{{self.pool}}}:"

    # routing table
    @property
    def current_version(self) -> str:
        """STRING: the decimal version of the current table; set in the same MULTI as its delta."""
        return f"{self.prefix}table:current"

    @property
    def snapshot(self) -> str:
        """STRING: one whole table (encode_table), at the version `table_log` names; rewritten at
        each compaction."""
        return f"{self.prefix}table:snapshot"

    @property
    def deltas(self) -> str:
        """ZSET: one member per version after the snapshot (encode_delta), scored by its version; the
        deltas of the period before the snapshot stay until the next compaction."""
        return f"{self.prefix}table:deltas"

    @property
    def table_log(self) -> str:
        """HASH: `snapshot` (the snapshot's version), `bytes` (the deltas written since it) and
        `epoch` (a random id of the delta chain, new whenever a table does not follow from the last)."""
        return f"{self.prefix}table:log"

    @property
    def versions_channel(self) -> str:
        """PUB/SUB channel: each new current version is published as its decimal number."""
        return f"{self.prefix}table:announce"

    # server registry
    @property
    def servers(self) -> str:
        """SET: ids of servers that have registered; an id whose record key expired is stale."""
        return f"{self.prefix}servers"

    def server(self, server_id: str) -> str:
        """STRING with TTL: the server's ServerRecord JSON; each heartbeat rewrites it and renews the TTL."""
        return f"{self.prefix}server:{server_id}"

    # adapter registry
    @property
    def adapters(self) -> str:
        """HASH: adapter name -> AdapterRecord JSON (without locations)."""
        return f"{self.prefix}adapters"

    @property
    def locations(self) -> str:
        """HASH: adapter name -> JSON list of the ids of servers that hold it in host memory."""
        return f"{self.prefix}locations"

    # demand
    def demand(self, bucket: int) -> str:
        """HASH with TTL: adapter name -> tokens counted during window `bucket` (HINCRBY)."""
        return f"{self.prefix}demand:{bucket}"
