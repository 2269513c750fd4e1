"""An adapter's registry record, written the same way by both drivers: the facts learnt from its files
(digest, rank, size, target modules, an activated LoRA's invocation; the operator reads them over https/hf, `loraplex up` from the
folder), checked against what the LoRADeployment declares, joined with the pool's base model.

A source the driver cannot read (file:// inside the pods, s3://, gs://) is registered with the declared
sha256 and rank alone, so its record cannot say the adapter is an activated LoRA. The agents can read
it: once one has loaded the adapter it reports the invocation in its heartbeat
(`ServerRecord.invocations`), and the driver writes it into the record (`with_reported_invocation`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from loraplex.routing.records import AdapterRecord, RecordError, ServerRecord
from loraplex.spec.crd import AdapterPoolSpec, AdapterSource, LoRADeploymentSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterFacts:
    digest: str  # "sha256:<hex>"
    rank: int
    size_bytes: int
    target_modules: tuple[str, ...] = ()
    invocation_tokens: tuple[int, ...] = ()  # an activated LoRA's (alora_invocation_tokens)


@dataclass(frozen=True)
class ConfigFacts:
    """What an adapter_config.json says of the adapter."""

    rank: int
    target_modules: tuple[str, ...] = ()
    invocation_tokens: tuple[int, ...] = ()

    def with_weights(self, digest: str, size_bytes: int) -> AdapterFacts:
        return AdapterFacts(digest, self.rank, size_bytes, self.target_modules, self.invocation_tokens)


class AdapterFactsError(ValueError):
    """`reason` is the CamelCase status reason the operator writes; the message says what is wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def declared_facts(adapter: AdapterSource) -> AdapterFacts | None:
    """The facts a LoRADeployment declares whole (sha256 and rank): nothing to read."""
    if adapter.sha256 and adapter.rank:
        return AdapterFacts(f"sha256:{adapter.sha256}", adapter.rank, 0)
    return None


def config_facts(config: object) -> ConfigFacts:
    """Rank, target modules and activated-LoRA invocation of a parsed adapter_config.json."""
    if not isinstance(config, dict):
        raise AdapterFactsError("InvalidAdapter", f"{CONFIG_FILE} is not a JSON object")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFactsError("InvalidAdapter", f"{CONFIG_FILE} has no positive integer rank 'r': {rank!r}")
    modules = config.get("target_modules") or ()
    invocation = config.get("alora_invocation_tokens") or ()
    if not isinstance(invocation, list | tuple):
        raise AdapterFactsError("InvalidAdapter", f"{CONFIG_FILE} has alora_invocation_tokens={invocation!r}, "
                                "not a list of token ids")
    return ConfigFacts(rank, tuple(modules) if isinstance(modules, list) else (), tuple(invocation))


def check_declared(adapter: AdapterSource, rank: int, digest: str | None = None) -> None:
    """AdapterFactsError when the files contradict the declared rank or sha256."""
    if adapter.rank is not None and adapter.rank != rank:
        raise AdapterFactsError("RankMismatch", f"spec.adapter.rank is {adapter.rank} but the adapter has r={rank}")
    if digest is not None and adapter.sha256 and digest != f"sha256:{adapter.sha256}":
        raise AdapterFactsError("DigestMismatch", f"weights digest is {digest}, spec.adapter.sha256 says "
                                f"sha256:{adapter.sha256}")


def adapter_record(name: str, facts: AdapterFacts, spec: LoRADeploymentSpec, pool: AdapterPoolSpec | None,
                   source: str | None = None) -> AdapterRecord:
    """The validated record of LoRADeployment `name` (`source`: the spec's, resolved by the driver).
    Without an AdapterPool (`loraplex up` with no -f) the base model is left unnamed."""
    try:
        return AdapterRecord(name, facts.digest, facts.rank, facts.size_bytes, source or spec.adapter.source,
                             facts.target_modules, pool.base_model.name if pool else "",
                             spec.traffic.expected_tokens_per_second,
                             invocation_tokens=facts.invocation_tokens).validate()
    except RecordError as exc:
        raise AdapterFactsError("InvalidAdapter", str(exc)) from exc


Invocations = Mapping[tuple[str, str], tuple[int, ...]]


def reported_invocations(servers: Iterable[ServerRecord]) -> dict[tuple[str, str], tuple[int, ...]]:
    """(adapter, digest) -> the activated-LoRA invocation the servers read from its files."""
    return {(name, digest): tuple(tokens) for s in servers for name, digest, tokens in s.invocations}


def with_reported_invocation(record: AdapterRecord, reported: Invocations) -> AdapterRecord:
    """`record`, with the invocation a server reported for its version when the record has none (its
    source was registered from declared facts)."""
    tokens = reported.get((record.name, record.digest))
    if record.invocation_tokens or not tokens:
        return record
    return replace(record, invocation_tokens=tokens).validate()
