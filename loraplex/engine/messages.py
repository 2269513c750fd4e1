"""Dataclass messages across the scheduler / executor seam: lists and ints, never tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.request import FinishReason, SampledToken
from loraplex.engine.sampling import SamplingParams
from loraplex.spec.adapter import AdapterId

NO_ADAPTER_SLOT = -1
"""`ScheduledChunk.adapter_slot` of a request that runs on the base model alone."""


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: a prefill chunk, or the last token for a decode."""

    request_id: str
    token_ids: list[int]  # tokens to run this step, at positions start_position..
    start_position: int  # tokens of this request already in the KV cache
    block_ids: list[int]  # the request's block table, covering start_position + len(token_ids); read-only, this step only
    adapter_slot: int  # device slot of the request's adapter, or NO_ADAPTER_SLOT
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    sampling: SamplingParams
    num_output_tokens: int = 0  # tokens generated so far (seeded sampling stays reproducible)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class AdapterLoad:
    """Copy an adapter's weights into a device slot before this step runs."""

    slot: int
    adapter: AdapterId
    rank: int


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    adapter_evictions: list[int] = field(default_factory=list)  # slots freed before this step
    finished_request_ids: list[str] = field(default_factory=list)  # executor may drop their state
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.adapter_loads and not self.adapter_evictions


@dataclass(slots=True)
class ExecutorResult:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # request_id -> next token
    elapsed_s: float = 0.0  # time the step took (measured, or modelled by a simulated executor)


@dataclass(slots=True)
class RequestOutput:
    """What a step produced for one request, sent to the frontend."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
