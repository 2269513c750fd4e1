"""A request as the engine sees it: token ids in, token ids out, plus bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from loraplex.engine.output.sampling import SamplingParams
from loraplex.spec.adapter import AdapterId


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped; recomputed on resume
    FINISHED = "finished"


NO_TOKEN = -1
"""What the sampler returns when JSON mode leaves no token to take (a vocabulary that cannot write
the next character): the request ends with finish_reason "length", its text cut short but never
invalid. The id is no token of any vocabulary and never reaches the model or the text."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # prompt logprobs: the token's rank in its distribution (1 = most likely)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: AdapterId | None = None
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    # first position the adapter's delta applies to: 0 for a standard LoRA; for an activated LoRA
    # its invocation's start (`loraplex.spec.alora`), set by `EngineCore.add_request`
    adapter_from: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    # `sampling.prompt_logprobs`: one entry per prompt token, the first None (nothing predicts it);
    # set by `LLM.generate` (the server reads them from the first `RequestOutput`)
    prompt_logprobs: list[SampledToken | None] | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        # The penalties, JSON mode and prompt logprobs read this request's tokens: its own copy of
        # the parameters points at it.
        if self.sampling.reads_history and self.sampling.history is not self:
            self.sampling = replace(self.sampling, history=self)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, count: int) -> list[int]:
        """`all_token_ids[start:start + count]` without building the whole list (a decode step
        asks for the last token only, a prefill chunk for part of the prompt)."""
        prompt = self.prompt_token_ids
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):start - len(prompt) + count]
        if start + count <= len(prompt):  # a prompt chunk
            return prompt[start:start + count]
        return (prompt + self.output_token_ids)[start:start + count]

    @property
    def cache_key(self) -> tuple[AdapterId | None, int]:
        """(adapter, start) of its prefix-cache key: the full blocks before the one holding `start`
        carry the base model's KV and are keyed as the base model's (shared with base requests and
        every aLoRA of the base); the blocks from there on by the adapter's identity (name + digest),
        so a repeat of the same aLoRA request reuses them and a reloaded adapter does not. A standard
        LoRA: (adapter, 0); a base request, or an aLoRA whose prompt lacks its invocation: (None, 0)."""
        if self.adapter is None or self.adapter_from >= self.num_tokens:
            return None, 0
        return self.adapter, self.adapter_from

    @property
    def reuses_cached_prefix(self) -> bool:
        """Whether admission may start it from the prefix cache. A cached prefix has KV but no
        logits, so a request that wants its prompt's logprobs computes its whole prompt."""
        return self.sampling.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

