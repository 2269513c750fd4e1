"""Routing schema of a pool: the versioned (adapter, server, φ) table, server and adapter registry
records, demand windows, the Redis key layout and the RoutingStore protocol. Pure: no redis import
here except in `redis_store` (import it explicitly where Redis is used)."""

from loraplex.routing.demand import DEFAULT_WINDOW_S, DEFAULT_WINDOWS, DemandWindows
from loraplex.routing.keys import PoolKeys, validate_pool_name
from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.records import AdapterRecord, RecordError, ServerLoad, ServerRecord
from loraplex.routing.store import RoutingStore, StaleVersionError, StoreUnavailableError, Subscription
from loraplex.routing.table import (
    Route,
    RoutingTable,
    RoutingTableError,
    TableEntry,
    decode_table,
    encode_table,
    make_entry,
)

__all__ = [
    "DEFAULT_WINDOWS", "DEFAULT_WINDOW_S", "AdapterRecord", "DemandWindows", "InMemoryRoutingStore", "PoolKeys",
    "RecordError", "Route", "RoutingStore", "RoutingTable", "RoutingTableError", "ServerLoad", "ServerRecord",
    "StaleVersionError", "StoreUnavailableError", "Subscription", "TableEntry", "decode_table", "encode_table",
    "make_entry", "validate_pool_name",
]
