"""Dataclass messages across the scheduler / executor seam: lists and ints, never tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import FinishReason, SampledToken
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
    adapter_from: int = 0  # positions before it run on the base model alone (an activated LoRA's prefix)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def adapter_slot_at(self, position: int) -> int:
        """The adapter slot of the token at `position`: `adapter_slot`, or NO_ADAPTER_SLOT before
        `adapter_from`."""
        return self.adapter_slot if position >= self.adapter_from else NO_ADAPTER_SLOT


@dataclass(slots=True)
class AdapterLoad:
    """Copy an adapter's weights from the host tier to the device.

    `slot` is the adapter's handle in `ScheduledChunk.adapter_slot`: a fixed device slot under
    `lru-static`, a handle into the page pool otherwise (then `pages` lists the device pages, in
    order, that receive the weights). A synchronous load is done before this step computes; an
    asynchronous one runs in the background and its `job` comes back in `ExecutorResult.copies_done`
    once the weights are on the device; no chunk uses the handle before that."""

    slot: int
    adapter: AdapterId
    rank: int
    pages: list[int] = field(default_factory=list)
    asynchronous: bool = False
    job: int = -1  # the copy's id when asynchronous


@dataclass(slots=True)
class KVCopy:
    """One KV block (all layers) between a device page and a host page."""

    device_page: int
    host_page: int


@dataclass(slots=True)
class KVSwapIn:
    """Copy KV blocks host -> device in the background; `job` comes back in `copies_done`."""

    job: int
    copies: list[KVCopy]


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    adapter_evictions: list[int] = field(default_factory=list)  # slots (handles) freed before this step
    kv_swap_out: list[KVCopy] = field(default_factory=list)  # device -> host, done before this step computes
    kv_swap_in: list[KVSwapIn] = field(default_factory=list)  # host -> device, in the background
    finished_request_ids: list[str] = field(default_factory=list)  # executor may drop their state
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.adapter_loads or self.adapter_evictions or self.kv_swap_out
                    or self.kv_swap_in)


@dataclass(slots=True)
class DecodeSpan:
    """The next `steps` steps are plain decodes of one unchanged batch (`BatchScheduler.decode_span`):
    `chunks` is the first of them; in each later one every chunk is one position further on. A
    simulated executor times them all at once, so a twin's cost follows events, not steps."""

    chunks: list[ScheduledChunk]
    steps: int
    until: float  # the steps must start before this time (a policy acts on the clock then)


@dataclass(slots=True)
class PromptLogprobs:
    """A prefill chunk's share of a request's prompt logprobs (`SamplingParams.prompt_logprobs`):
    the prompt tokens at positions `first_position`, `first_position + 1`, ..., each with its
    logprob given the tokens before it (and its rank and the top k)."""

    first_position: int  # >= 1: nothing predicts the first prompt token
    tokens: list[SampledToken]


@dataclass(slots=True)
class ExecutorResult:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # request_id -> next token
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # request_id -> this step's share
    elapsed_s: float = 0.0  # time the step took (measured, or modelled by a simulated executor)
    copies_done: list[int] = field(default_factory=list)  # jobs of background copies now finished
    copy_bytes: int = 0  # host <-> device bytes this step moved or started moving


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
    # with the first token of a request that asked for them: one per prompt token, the first None
    prompt_logprobs: list[SampledToken | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (`Request.num_cached_tokens`)
