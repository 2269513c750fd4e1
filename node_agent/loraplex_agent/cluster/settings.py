"""How an agent joins its pool: read from the `loraplex agent` command line."""

from __future__ import annotations

import argparse
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.routing.keys import validate_pool_name
from loraplex.routing.records import RecordError, validate_server_id
from loraplex.spec.errors import CommandError
from loraplex_agent.cluster.limits import DEFAULT_SCHEMES
from loraplex_agent.cluster.sources import SourcePolicy

KNOWN_SCHEMES = DEFAULT_SCHEMES | {"http"}


@dataclass(frozen=True)
class ClusterSettings:
    redis_url: str
    pool: str
    server_id: str
    advertise_url: str
    adapter_store: Path
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    poll_interval_s: float = 2.0
    prefetch_concurrency: int = 4
    sources: SourcePolicy = field(default_factory=SourcePolicy)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterSettings:
        server_id = args.server_id or socket.gethostname()
        advertise = args.advertise_url or f"http://{args.host}:{args.port}"
        try:
            validate_pool_name(args.pool)
            validate_server_id(server_id)
        except (ValueError, RecordError) as exc:
            raise CommandError(str(exc)) from exc
        if args.heartbeat_ttl <= args.heartbeat_interval:
            raise CommandError("--heartbeat-ttl must be longer than --heartbeat-interval")
        store = Path(args.adapter_store or Path(tempfile.gettempdir()) / "loraplex-adapters" / server_id)
        return cls(args.redis_url, args.pool, server_id, advertise.rstrip("/"), store,
                   args.heartbeat_interval, args.heartbeat_ttl,
                   sources=SourcePolicy(_schemes(args.source_schemes), _max_bytes(args.max_adapter_bytes)))


def _schemes(text: str) -> frozenset[str]:
    """--source-schemes: a comma-separated subset of the schemes the agent can fetch."""
    schemes = frozenset(s.strip().lower().removesuffix("://") for s in text.split(",") if s.strip())
    unknown = sorted(schemes - KNOWN_SCHEMES)
    problem = f"unknown {', '.join(unknown)}" if unknown else "empty" if not schemes else ""
    if problem:
        raise CommandError(f"--source-schemes {text!r}: {problem} (known: {','.join(sorted(KNOWN_SCHEMES))})")
    return schemes


def _max_bytes(value: float) -> int:
    if not value >= 1:  # also NaN
        raise CommandError(f"--max-adapter-bytes must be at least 1, got {value}")
    return int(value)
