"""What the cluster side needs from the serving engine: the agent's AsyncEngine, or a vLLM server
seen through loraplex_agent.vllm_backend.engine.VllmEngine.

An engine may offer, besides `adapters`, `add_adapter` and `remove_adapter`:
- `healthy` (bool): while False the member leaves the registry (default: always healthy);
- `cluster_report()` -> (ServerLoad, GPU-resident adapter names, ServerBatch | None), instead of the
  AsyncEngine's step snapshot;
- `busy_adapters()` -> names with requests running or waiting there, never evicted under them;
- `kv_block_size` (int, 0: unknown): tokens per KV block, instead of the AsyncEngine's config."""

from __future__ import annotations

from loraplex.engine.request import RequestStatus
from loraplex.routing.records import ServerBatch, ServerLoad


def engine_report(engine) -> tuple[ServerLoad, tuple[str, ...], ServerBatch | None]:
    """(load, GPU-resident adapters, live batch) for the heartbeat."""
    report = getattr(engine, "cluster_report", None)
    if report is not None:
        return report()
    load, gpu = engine_load(engine)
    return load, gpu, engine_batch(engine)


def engine_block_size(engine) -> int:
    """Tokens per KV block of the engine, for the heartbeat (prefix-aware routing); 0 when unknown."""
    size = getattr(engine, "kv_block_size", None)
    if size is None:
        core = getattr(engine, "core", None)
        size = core.config.block_size if core is not None else 0
    return int(size)


def busy_adapters(engine) -> frozenset[str]:
    """Adapters the engine itself says are in use (the member pins the ones it routes itself)."""
    busy = getattr(engine, "busy_adapters", None)
    return frozenset(busy()) if busy is not None else frozenset()


def engine_load(engine) -> tuple[ServerLoad, tuple[str, ...]]:
    """(load, GPU-resident adapter names) from the engine's last step snapshot."""
    snap = engine.snapshot()
    stats = snap.stats
    load = ServerLoad(running=stats.num_running, waiting=stats.num_waiting, kv_usage=round(stats.kv_usage, 4))
    return load, tuple(snap.resident_adapters)


def engine_batch(engine) -> ServerBatch | None:
    """The engine's open requests (running and waiting) by rank, for rank-aware routing; None when
    the engine does not expose them.

    Runs on the event loop while the engine thread steps: the request table is copied in one
    C-level call (atomic under the GIL) and a request's counters are plain ints, so the batch is at
    worst one step old. Ranks come from the loop's own view of the loaded adapters."""
    streams = getattr(engine, "_streams", None)
    if streams is None:
        return None
    try:
        requests = [stream.request for stream in list(streams.values())]
    except RuntimeError:  # resized while copied (free-threaded Python): report none this time
        return None
    ranks = {name: loaded.info.rank for name, loaded in engine.adapters.items()}
    return ServerBatch.from_requests(
        (ranks.get(r.adapter.name, 0) if r.adapter else 0, r.adapter.name if r.adapter else None,
         max(0, r.num_prompt_tokens - r.num_computed_tokens), r.num_tokens)
        for r in requests if r.status is not RequestStatus.FINISHED)
