"""What the operator learns about an adapter before it enters the registry: digest, rank, size.

Placement is rank-aware and agents verify the digest when they fetch, so both are needed up front.
From https:// and hf:// sources (with the token of the referenced Secret) the operator always reads
`adapter_config.json` (small: the rank, the target modules and an activated LoRA's invocation, which
decides where the adapter may be placed) and hashes `adapter_model.safetensors` unless the
LoRADeployment declares `sha256` and `rank`. file:// paths live inside the agent pods and s3:// /
gs:// need cloud SDKs the slim operator image does not carry: those sources must declare both values,
and the status says so. Their activated-LoRA invocation comes later, from the agents that load them
(`loraplex.pool.records.with_reported_invocation`, written by the pool's tick)."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Mapping

from loraplex.pool.records import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFacts,
    AdapterFactsError,
    check_declared,
    config_facts,
    declared_facts,
)
from loraplex.spec.crd import AdapterSource

MAX_WEIGHTS_BYTES = 8 << 30
_CHUNK = 1 << 20
HF_ENDPOINT = "https://huggingface.co"
READABLE_SCHEMES = ("https://", "hf://")  # what the operator reads itself


class InspectionError(RuntimeError):
    """`reason` is the CamelCase status reason; `retryable` says whether trying again may help."""

    def __init__(self, reason: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.retryable = reason, message, retryable


def file_url(source: str, file_name: str, hf_endpoint: str = HF_ENDPOINT) -> str:
    """The https URL of one file of an https:// or hf://org/name[@revision] adapter folder."""
    if source.startswith("hf://"):
        repo, _, revision = source.removeprefix("hf://").partition("@")
        return f"{hf_endpoint}/{repo.strip('/')}/resolve/{revision or 'main'}/{file_name}"
    if source.startswith("https://"):
        return f"{source.rstrip('/')}/{file_name}"
    raise InspectionError("DeclareDigestAndRank", f"the operator cannot read {source.split('://')[0]}:// "
                          "sources; set spec.adapter.sha256 and spec.adapter.rank (agents verify them on load)")


class SourceInspector:
    def __init__(self, timeout_s: float = 30.0, hf_endpoint: str = HF_ENDPOINT,
                 max_bytes: int = MAX_WEIGHTS_BYTES) -> None:
        self._timeout, self._hf, self._max = timeout_s, hf_endpoint, max_bytes

    def inspect(self, adapter: AdapterSource, credentials: Mapping[str, str]) -> AdapterFacts:
        declared = declared_facts(adapter)
        if declared is not None and not adapter.source.startswith(READABLE_SCHEMES):
            return declared
        headers = {"Authorization": f"Bearer {credentials['HF_TOKEN']}"} if "HF_TOKEN" in credentials else {}
        try:
            config = config_facts(self._config(file_url(adapter.source, CONFIG_FILE, self._hf), headers))
            check_declared(adapter, config.rank)
            if declared is not None:  # the weights are not fetched: the agents verify the digest when they load them
                digest, size = declared.digest, 0
            else:
                digest, size = self._hash(file_url(adapter.source, WEIGHTS_FILE, self._hf), headers)
                check_declared(adapter, config.rank, digest)
        except AdapterFactsError as exc:
            raise InspectionError(exc.reason, exc.message) from exc
        return config.with_weights(digest, size)

    def _open(self, url: str, headers: Mapping[str, str]):  # noqa: ANN202 - an http.client response
        try:
            return urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers)), timeout=self._timeout)
        except urllib.error.HTTPError as exc:
            retry = exc.code >= 500 or exc.code == 429
            raise InspectionError("SourceUnreadable", f"GET {url}: HTTP {exc.code}", retryable=retry) from exc
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise InspectionError("SourceUnreachable", f"GET {url}: {exc}", retryable=True) from exc

    def _config(self, url: str, headers: Mapping[str, str]) -> object:
        with self._open(url, headers) as response:
            try:
                doc = json.loads(response.read(1 << 20))
            except ValueError as exc:
                raise InspectionError("InvalidAdapter", f"{CONFIG_FILE} is not JSON: {exc}") from exc
        return doc

    def _hash(self, url: str, headers: Mapping[str, str]) -> tuple[str, int]:
        sha, size = hashlib.sha256(), 0
        with self._open(url, headers) as response:
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > self._max:
                    raise InspectionError("AdapterTooLarge", f"{WEIGHTS_FILE} is larger than {self._max} bytes")
                sha.update(chunk)
        return f"sha256:{sha.hexdigest()}", size
