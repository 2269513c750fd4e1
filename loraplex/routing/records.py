"""Registry records: what a server reports about itself and what the pool knows about an adapter.
Both encode to JSON for the store; decoding rejects malformed records with RecordError."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from loraplex.spec.adapter import validate_adapter_name

_SERVER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class RecordError(ValueError):
    """A registry record that is malformed or breaks a field rule."""


def validate_server_id(server_id: str) -> str:
    if not isinstance(server_id, str) or not _SERVER_ID.match(server_id):
        raise RecordError(f"invalid server id {server_id!r}: use letters, digits, '.', '_' or '-'")
    return server_id


@dataclass(frozen=True)
class ServerLoad:
    """The load a server reported with its last heartbeat."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV pages in use, 0..1


@dataclass(frozen=True)
class ServerRecord:
    """One engine instance (one agent). The record lives under a key with a TTL that every heartbeat
    renews, so a server that stops heartbeating drops out of the registry by itself."""

    id: str
    url: str
    max_rank: int
    base_model: str = ""
    capabilities: tuple[str, ...] = ()
    load: ServerLoad = field(default_factory=ServerLoad)
    gpu_adapters: tuple[str, ...] = ()   # adapter names resident in GPU memory
    host_adapters: tuple[str, ...] = ()  # adapter names held in host memory (the distributed pool)
    heartbeat_at: float = 0.0            # the agent's wall clock when it sent this record

    def validate(self) -> ServerRecord:
        validate_server_id(self.id)
        if not self.url.startswith(("http://", "https://")):
            raise RecordError(f"server {self.id!r}: url must be http(s)://, got {self.url!r}")
        if self.max_rank <= 0:
            raise RecordError(f"server {self.id!r}: max_rank must be positive, got {self.max_rank}")
        return self

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerRecord:
        try:
            doc = json.loads(text)
            load = ServerLoad(**doc.pop("load", {}))
            for name in ("capabilities", "gpu_adapters", "host_adapters"):
                doc[name] = tuple(doc.get(name, ()))
            return cls(load=load, **doc).validate()
        except (ValueError, TypeError, AttributeError) as exc:
            raise RecordError(f"malformed server record: {exc}") from exc


@dataclass(frozen=True)
class AdapterRecord:
    """An adapter of the pool (written by the operator or `loraplex up` from a LoRADeployment).
    `locations` (servers holding it in host memory) is kept in the store apart from the record, written
    by agents after a fetch or delete, and filled in when the record is read."""

    name: str
    digest: str
    rank: int
    size_bytes: int
    source: str
    target_modules: tuple[str, ...] = ()
    base_model: str = ""
    expected_tps: float = 0.0  # declared tokens/s, used while no demand has been observed
    locations: frozenset[str] = frozenset()

    def validate(self) -> AdapterRecord:
        validate_adapter_name(self.name)
        if not self.digest.startswith("sha256:"):
            raise RecordError(f"adapter {self.name!r}: digest must be 'sha256:<hex>', got {self.digest!r}")
        if self.rank <= 0 or self.size_bytes < 0 or self.expected_tps < 0:
            raise RecordError(f"adapter {self.name!r}: rank must be positive and size/expected_tps >= 0")
        if not self.source:
            raise RecordError(f"adapter {self.name!r} has no source")
        return self

    def to_json(self) -> str:
        """Without `locations`: they have their own key so agents never rewrite the record."""
        doc = asdict(self)
        del doc["locations"]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, locations: frozenset[str] = frozenset()) -> AdapterRecord:
        try:
            doc = json.loads(text)
            doc["target_modules"] = tuple(doc.get("target_modules", ()))
            return cls(locations=locations, **doc).validate()
        except (ValueError, TypeError, AttributeError) as exc:
            raise RecordError(f"malformed adapter record: {exc}") from exc
