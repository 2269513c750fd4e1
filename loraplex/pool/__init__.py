"""The pool control plane (pure): how an AdapterPool spec becomes a placement controller, a refusal or
an adapter's registry record, and a pool's LoRADeployments its replica bounds. Two drivers call it and
keep no copy: the operator (API server, pods) and `loraplex up` (files, processes). docs/architecture.md
"One pool control plane"."""

from loraplex.pool.bounds import ReplicaBounds, replica_bounds
from loraplex.pool.controller import build_controller, routing_pending
from loraplex.pool.policy import MAX_SERVER_LOAD, PoolPolicy, server_loads
from loraplex.pool.records import (
           AdapterFacts,
           AdapterFactsError,
           adapter_record,
           check_declared,
           config_facts,
)
from loraplex.pool.refusal import (
           INVALID_ENGINE,
           INVALID_ROUTING,
           VOLUME_CONFLICT,
           spec_failure,
           volume_conflicts,
)

__all__ = ["INVALID_ENGINE", "INVALID_ROUTING", "MAX_SERVER_LOAD", "VOLUME_CONFLICT", "AdapterFacts",
           "AdapterFactsError", "PoolPolicy", "ReplicaBounds", "adapter_record", "build_controller", "check_declared",
           "config_facts", "replica_bounds", "routing_pending", "server_loads", "spec_failure", "volume_conflicts"]
