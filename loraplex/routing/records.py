"""Registry records: what a server reports about itself and what the pool knows about an adapter.
Both encode to JSON for the store; decoding rejects malformed records with RecordError."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

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


class RankLoad(NamedTuple):
    """The requests of one rank in a server's batch (rank 0: the base model, no adapter)."""

    rank: int
    requests: int  # running + waiting
    prefill_tokens: int = 0  # prompt tokens of those requests not prefilled yet


BatchRow = tuple[int, str | None, int, int]  # (rank, adapter name or None, prompt tokens left, context tokens)
MAX_BATCH_ADAPTERS = 512  # a heartbeat lists at most this many distinct adapters of its batch


@dataclass(frozen=True)
class ServerBatch:
    """A server's live batch, what rank-aware routing reads (Toppings' `GetStats()`): its open
    requests (running and waiting) counted by rank, compact whatever the batch size. Encoded in the
    heartbeat as `{"ranks": [[rank, requests, prefill_tokens], ...], "adapters": [...], ...}`."""

    ranks: tuple[RankLoad, ...] = ()  # ascending rank, one entry per rank present
    adapters: tuple[str, ...] = ()  # distinct adapters of those requests, sorted
    context_tokens: int = 0  # KV positions the requests will attend over (prompt + output so far), summed
    max_context: int = 0  # the longest of them

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.ranks)

    @classmethod
    def from_requests(cls, rows: Iterable[BatchRow]) -> ServerBatch:
        """Aggregate (rank, adapter, prompt tokens left to prefill, context tokens) per open request."""
        counts: dict[int, list[int]] = {}
        adapters: set[str] = set()
        context = longest = 0
        for rank, adapter, pending, tokens in rows:
            entry = counts.setdefault(rank, [0, 0])
            entry[0] += 1
            entry[1] += pending
            if adapter is not None:
                adapters.add(adapter)
            context += tokens
            longest = max(longest, tokens)
        return cls(tuple(RankLoad(r, n, p) for r, (n, p) in sorted(counts.items())),
                   tuple(sorted(adapters)[:MAX_BATCH_ADAPTERS]), context, longest)

    def with_open_requests(self, open_requests: int) -> ServerBatch:
        """The batch with the requests a router knows it has open there beyond the reported ones (sent
        since the heartbeat), counted at the batch's mean rank (their ranks are not reported): a burst
        routed between two heartbeats must not all land on the server that looked emptiest."""
        extra = open_requests - self.requests
        if extra <= 0:
            return self
        total = self.requests
        rank = round(sum(r.rank * r.requests for r in self.ranks) / total) if total else 0
        counts = {r.rank: r for r in self.ranks}
        old = counts.get(rank, RankLoad(rank, 0, 0))
        counts[rank] = RankLoad(rank, old.requests + extra, old.prefill_tokens)
        mean_context = self.context_tokens // total if total else 0
        return ServerBatch(tuple(counts[r] for r in sorted(counts)), self.adapters,
                           self.context_tokens + extra * mean_context, self.max_context)

    def validate(self) -> ServerBatch:
        if any(r.rank < 0 or r.requests < 0 or r.prefill_tokens < 0 for r in self.ranks):
            raise RecordError(f"batch ranks must be non-negative, got {self.ranks}")
        if self.context_tokens < 0 or self.max_context < 0:
            raise RecordError("batch context tokens must be non-negative")
        return self

    @classmethod
    def from_doc(cls, doc: dict) -> ServerBatch:
        return cls(ranks=tuple(RankLoad(*(int(x) for x in row)) for row in doc.get("ranks", ())),
                   adapters=tuple(str(a) for a in doc.get("adapters", ())),
                   context_tokens=int(doc.get("context_tokens", 0)), max_context=int(doc.get("max_context", 0)))


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
    batch: ServerBatch | None = None     # the live batch; None from agents that do not report it
    backend: str = "loraplex"            # the engine behind `url`: loraplex, or vllm (an unmodified vLLM server)
    agent_url: str = ""                  # the agent's own URL when it is not `url` (backend vllm): peers fetch here
    max_adapters: int = 0                # adapters the server can hold at once (vLLM's max_cpu_loras); 0: no limit
    block_size: int = 0                  # tokens per KV block of its engine; 0: unknown
    # (adapter, digest, why) of each registered adapter version its engine refused to load, once fetched
    # and verified (an activated LoRA on the vllm backend, a PEFT feature it lacks): the operator fails it
    refused: tuple[tuple[str, str, str], ...] = ()
    # (adapter, digest, invocation) of each activated LoRA it loaded whose registry record lacks the
    # invocation (a source only the agents read: file://, s3://, gs://): the pool's driver writes it in
    invocations: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    @property
    def peer_url(self) -> str:
        """Where peers fetch this server's adapters: its agent."""
        return self.agent_url or self.url

    def validate(self) -> ServerRecord:
        validate_server_id(self.id)
        if not self.url.startswith(("http://", "https://")):
            raise RecordError(f"server {self.id!r}: url must be http(s)://, got {self.url!r}")
        if self.max_rank <= 0:
            raise RecordError(f"server {self.id!r}: max_rank must be positive, got {self.max_rank}")
        if self.agent_url and not self.agent_url.startswith(("http://", "https://")):
            raise RecordError(f"server {self.id!r}: agent_url must be http(s)://, got {self.agent_url!r}")
        if self.max_adapters < 0:
            raise RecordError(f"server {self.id!r}: max_adapters must be >= 0, got {self.max_adapters}")
        if self.block_size < 0:
            raise RecordError(f"server {self.id!r}: block_size must be >= 0, got {self.block_size}")
        if not all(len(r) == 3 and all(isinstance(x, str) for x in r) for r in self.refused):
            raise RecordError(f"server {self.id!r}: refused must hold (adapter, digest, why), got {self.refused!r}")
        if not all(len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str) and r[2]
                   and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r[2])
                   for r in self.invocations):
            raise RecordError(f"server {self.id!r}: invocations must hold (adapter, digest, token ids), "
                              f"got {self.invocations!r}")
        if self.batch is not None:
            self.batch.validate()
        return self

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerRecord:
        try:
            doc = json.loads(text)
            load = ServerLoad(**doc.pop("load", {}))
            batch = doc.pop("batch", None)
            for name in ("capabilities", "gpu_adapters", "host_adapters"):
                doc[name] = tuple(doc.get(name, ()))
            doc["refused"] = tuple(tuple(r) for r in doc.get("refused", ()))
            doc["invocations"] = tuple((n, d, tuple(t)) for n, d, t in doc.get("invocations", ()))
            return cls(load=load, batch=None if batch is None else ServerBatch.from_doc(batch), **doc).validate()
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
    # an activated LoRA's invocation (PEFT's alora_invocation_tokens); empty for a standard LoRA
    invocation_tokens: tuple[int, ...] = ()

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_tokens)

    def validate(self) -> AdapterRecord:
        validate_adapter_name(self.name)
        if not self.digest.startswith("sha256:"):
            raise RecordError(f"adapter {self.name!r}: digest must be 'sha256:<hex>', got {self.digest!r}")
        if self.rank <= 0 or self.size_bytes < 0 or self.expected_tps < 0:
            raise RecordError(f"adapter {self.name!r}: rank must be positive and size/expected_tps >= 0")
        if not self.source:
            raise RecordError(f"adapter {self.name!r} has no source")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.invocation_tokens):
            raise RecordError(f"adapter {self.name!r}: invocation tokens must be token ids, got {self.invocation_tokens!r}")
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
            doc["invocation_tokens"] = tuple(doc.get("invocation_tokens", ()))
            return cls(locations=locations, **doc).validate()
        except (ValueError, TypeError, AttributeError) as exc:
            raise RecordError(f"malformed adapter record: {exc}") from exc
