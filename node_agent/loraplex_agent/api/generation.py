"""One request from token ids to text deltas: detokenization, stop strings, finish reasons, metrics.

Both endpoints (completions and chat) consume the same stream of `TextDelta`s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from loraplex.engine.messages import RequestOutput
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import NO_TOKEN, FinishReason, Request, SampledToken
from loraplex.spec.errors import LoraplexError
from loraplex_agent.api.detokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from loraplex_agent.api.metrics import ServerMetrics
from loraplex_agent.runtime.async_engine import AsyncEngine


@dataclass
class GenerationJob:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str | None  # None: the base model alone
    eos_token_ids: tuple[int, ...]
    arrival: float = field(default_factory=time.monotonic)  # latencies count from here (a fan-out's prefill included)


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]  # the tokens behind this delta (an EOS or stop token id is left out)
    logprobs: list[SampledToken]  # one per token id when logprobs were asked for, else empty
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: float = 0.0  # sum over every generated token so far (EOS included); 0 without logprobs
    prompt_logprobs: list[SampledToken | None] | None = None  # in the first delta, when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


async def generate_text(engine: AsyncEngine, tokenizer: Tokenizer, metrics: ServerMetrics,
                        job: GenerationJob) -> AsyncIterator[TextDelta]:
    """Stream `job`'s text. Leaving the iteration early (a disconnect, a stop string) aborts it."""
    request = Request(job.request_id, job.prompt_token_ids, job.sampling, eos_token_ids=job.eos_token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, job.prompt_token_ids)
    stops = StopStringMatcher(job.sampling.stop)
    timer = _Timer(metrics, job.arrival)
    reason: str | None = FinishReason.ABORT.value
    cumulative = 0.0
    try:
        async with aclosing(engine.generate(request, job.adapter)) as outputs:
            async for output in outputs:
                timer.token()
                text_ids = _text_ids(output)
                piece = detokenizer.add(text_ids) + (detokenizer.flush() if output.finished else "")
                text = stops.add(piece, final=output.finished)
                finish = _finish_reason(output.finish_reason if output.finished else None, stops.stopped)
                logprobs = output.new_logprobs[:len(text_ids)] if job.sampling.logprobs is not None else []
                cumulative += sum(t.logprob for t in output.new_logprobs if t.logprob is not None)
                yield TextDelta(text, text_ids, logprobs, finish, output.num_prompt_tokens,
                                output.num_output_tokens, cumulative, output.prompt_logprobs,
                                output.num_cached_tokens)
                if finish is not None:
                    reason = finish
                    return  # leaving `aclosing` aborts a request cut short by a stop string
    except LoraplexError:
        reason = None  # refused (unknown adapter, too long, engine down): not a finished request
        raise
    finally:
        if reason is not None:
            timer.finished(reason, job.adapter, request)


def _text_ids(output: RequestOutput) -> list[int]:
    """The new tokens that are text: an EOS or stop token id ends the text without being part of
    it, and so does JSON mode's NO_TOKEN (no token could continue)."""
    ids = output.new_token_ids
    if output.finished and (output.finish_reason == FinishReason.STOP or ids[-1:] == [NO_TOKEN]):
        return ids[:-1]
    return ids


def _finish_reason(engine_reason: FinishReason | None, stop_string: bool) -> str | None:
    if stop_string:
        return FinishReason.STOP.value
    return engine_reason.value if engine_reason is not None else None


class _Timer:
    """Latencies seen by the client: time to first token, gaps between tokens, end to end."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.metrics.observe_first_token(now - self.start)
        else:
            self.metrics.observe_token_gap(now - self.last)
        self.last = now

    def finished(self, reason: str, adapter: str | None, request: Request) -> None:
        queued = None
        if request.first_scheduled_time is not None and request.arrival_time:
            queued = request.first_scheduled_time - request.arrival_time
        self.metrics.observe_finished(reason, adapter, time.monotonic() - self.start, queued)
