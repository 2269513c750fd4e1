"""Feed a trace into an EngineCore at its arrival times and step it until every request is done.

The same loop drives the twin (a virtual clock that jumps to the next arrival when the engine is
idle) and the real engine (wall time: it sleeps until the next arrival), so both see requests
exactly alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.sim.executor import SimExecutor
from loraplex.sim.spans import step
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.spec.adapter import AdapterId, AdapterInfo

Prompt = Callable[[TraceRequest], list[int]]
PROGRESS_EVERY = 1024  # arrivals between two progress reports
WaitUntil = Callable[[float], None]


def check_fits(trace: Trace, max_model_len: int, max_lora_rank: int) -> None:
    """The twin refuses a trace the engine would reject, rather than fail half-way through it."""
    rows = trace.rows()
    longest = int(rows.tokens().max(initial=0))
    if longest > max_model_len:
        raise ValueError(f"the trace has a request of {longest} tokens but the engine's max_model_len is "
                         f"{max_model_len}; generate it with `loraplex workload generate --max-model-len "
                         f"{max_model_len}` (lengths.max_model_len in a spec)")
    top = int(rows.rank.max(initial=0))
    if top > max_lora_rank:
        raise ValueError(f"the trace has rank-{top} adapters but the engine's max_lora_rank is {max_lora_rank}; "
                         f"generate it with `loraplex workload generate --max-rank {max_lora_rank}` "
                         "(adapters.ranks in a spec)")


def sim_adapter_id(name: str) -> AdapterId:
    return AdapterId(name, f"sha256:sim-{name}")


def register_adapters(core: EngineCore, adapters: dict[str, int], ids: dict[str, AdapterId] | None = None,
                      bytes_per_rank: int = 0,
                      invocations: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, AdapterId]:
    """Add each (name -> rank) adapter to the engine, those in `invocations` as activated LoRAs;
    returns name -> AdapterId."""
    ids, invocations = dict(ids or {}), invocations or {}
    for name, rank in adapters.items():
        ids.setdefault(name, sim_adapter_id(name))
        core.add_adapter(AdapterInfo(ids[name], rank, rank * bytes_per_rank,
                                     invocation_tokens=invocations.get(name, ())))
    return ids


def make_request(request: TraceRequest, origin: float, adapter: AdapterId | None, prompt: Prompt) -> Request:
    return Request(request.request_id, prompt(request), replay_sampling(request.output_len),
                   adapter=adapter, arrival_time=origin + request.arrival_s)


@lru_cache(maxsize=4096)
def replay_sampling(max_tokens: int) -> SamplingParams:
    """A replayed request generates exactly `max_tokens` tokens. SamplingParams is frozen, so requests of
    one length share one instance (validated once, not once per request)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


@dataclass
class ReplayLog:
    requests: list[Request]  # every request of the trace, with its timestamps filled in
    origin: float  # clock reading at trace time 0
    end: float  # clock reading when the last request finished (or the horizon was hit)


def replay(core: EngineCore, trace: Trace, ids: dict[str, AdapterId], prompt: Prompt,
           wait_until: WaitUntil, horizon_s: float | None = None, spans: SimExecutor | None = None,
           progress: Callable[[float], None] | None = None) -> ReplayLog:
    """Run `trace` to completion, or until `horizon_s` of trace time has passed. With `spans` (the
    twin's executor of `core`), plain decode steps between two arrivals run at once (`sim.spans`).
    `progress` is told the trace time every PROGRESS_EVERY arrivals."""
    clock = core.clock
    origin = clock.now()
    pending = iter(trace.requests)  # rows of a columnar trace are built one at a time, as they arrive
    admitted: list[Request] = []
    r = next(pending, None)
    i = 0
    while r is not None or core.has_unfinished():
        now = clock.now()
        if horizon_s is not None and now - origin >= horizon_s:
            break
        while r is not None and origin + r.arrival_s <= now:
            request = make_request(r, origin, ids[r.adapter] if r.adapter else None, prompt)
            core.add_request(request)
            admitted.append(request)
            i += 1
            if progress is not None and i % PROGRESS_EVERY == 0:
                progress(r.arrival_s)
            r = next(pending, None)
        if core.has_unfinished():
            if spans is None:
                steps = core.num_steps
                moved = bool(core.step()) or core.num_steps != steps
            else:
                until = origin + r.arrival_s if r is not None else math.inf
                if horizon_s is not None:
                    until = min(until, origin + horizon_s)
                moved = step(core, spans, until, strict=True) is not None
            if not moved and core.has_unfinished():
                raise RuntimeError("the engine admits none of its waiting requests while idle")
        elif r is not None:
            wait_until(origin + r.arrival_s)
    return ReplayLog(admitted, origin, clock.now())
