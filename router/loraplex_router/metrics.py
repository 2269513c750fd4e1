"""The router's Prometheus metrics, in a registry of their own (one per app, so tests and several
apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplex_router_requests", "Requests answered, by model and status code",
                                ["model", "code"], registry=r)
        self.tokens = Counter("loraplex_router_tokens", "Tokens served, by model and kind (prompt|completion)",
                              ["model", "kind"], registry=r)
        self.upstream_failures = Counter("loraplex_router_upstream_failures",
                                         "Attempts that failed before the first byte, by server",
                                         ["server"], registry=r)
        self.retries = Counter("loraplex_router_retries", "Requests sent again to another server", registry=r)
        self.picks = Counter("loraplex_router_picks", "Servers chosen by the routing profile", ["server"],
                             registry=r)
        self.time_to_first_byte = Histogram("loraplex_router_time_to_first_byte_seconds",
                                            "From arrival to the first byte from a server",
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("loraplex_router_request_duration_seconds", "From arrival to the last byte",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("loraplex_router_requests_in_flight", "Open requests, by server", ["server"],
                               registry=r)
        self.table_version = Gauge("loraplex_router_routing_table_version", "Version of the routing table in use",
                                   registry=r)
        self.snapshot_age = Gauge("loraplex_router_snapshot_age_seconds",
                                  "Seconds since the snapshot was last read from the store", registry=r)
        self.store_errors = Counter("loraplex_router_store_errors", "Failed reads or writes to the store",
                                    registry=r)
        self.servers = Gauge("loraplex_router_servers", "Live servers in the snapshot", registry=r)
        self.routing_profile = Info("loraplex_router_routing_profile", "The routing profile in use, and where "
                                    "it comes from (table: the pool's spec.routing; flags: --profile)", registry=r)
        self.prefix_blocks = Counter("loraplex_router_prefix_blocks",
                                     "Prefix blocks of routed requests (prefix-aware profiles), by kind: requested "
                                     "(every block) or matched (those the chosen server was predicted to hold); "
                                     "matched / requested is the hit rate the router predicted", ["kind"],
                                     registry=r)
        self.prefix_index_keys = Gauge("loraplex_router_prefix_index_keys",
                                       "Prefix keys in the router's index, all servers together", registry=r)
        self._outliers(r)

    def _outliers(self, r: CollectorRegistry) -> None:
        self.abandoned = Counter("loraplex_router_attempts_abandoned",
                                 "Attempts given up before their first byte and sent elsewhere, by server and "
                                 "reason (deadline|silent|ejected|gone)", ["server", "reason"], registry=r)
        self.ejections = Counter("loraplex_router_ejections", "Servers ejected by outlier detection, by server "
                                 "and the failure that ejected them (deadline|transport|connect|silent)",
                                 ["server", "reason"], registry=r)
        self.ejection_overflows = Counter("loraplex_router_ejection_overflows",
                                          "Ejections not made because the max ejected fraction was out", registry=r)
        self.servers_dropped = Counter("loraplex_router_servers_dropped",
                                       "Silent servers removed from the registry before their heartbeat TTL ran "
                                       "out", ["server"], registry=r)
        self.ejected = Gauge("loraplex_router_ejected_servers", "Servers ejected now", registry=r)
        self.ttfb_deadline = Gauge("loraplex_router_ttfb_deadline_seconds",
                                   "The time-to-first-byte deadline of streamed requests now (+Inf: none)",
                                   registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
