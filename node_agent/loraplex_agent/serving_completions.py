"""POST /v1/completions: one prompt (text or token ids) in, text out, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from loraplex_agent.generation import GenerationJob, TextDelta
from loraplex_agent.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from loraplex_agent.serving import SSE_DONE, ServingContext, chain, sse, sse_error


async def create_completion(ctx: ServingContext, req: CompletionRequest
                            ) -> CompletionResponse | AsyncIterator[str]:
    """The whole response, or (when `req.stream`) the SSE lines of the stream."""
    req.check_supported()
    adapter = ctx.resolve_model(req.model)
    prompt_ids = ctx.tokenize(req.single_prompt())
    sampling = ctx.sampling_params(req, len(prompt_ids), req.max_tokens, req.logprobs, "prompt")
    job = ctx.job("cmpl", prompt_ids, sampling, adapter)
    first, deltas = await ctx.start(job)
    if req.stream:
        return _stream(ctx, req, job, first, deltas)
    return await _collect(ctx, req, job, first, deltas)


async def _collect(ctx: ServingContext, req: CompletionRequest, job: GenerationJob, first: TextDelta,
                   deltas: AsyncIterator[TextDelta]) -> CompletionResponse:
    logprobs = _LogprobsBuilder(ctx) if req.logprobs is not None else None
    text, last = [], first
    async with aclosing(deltas):
        async for delta in chain(first, deltas):
            text.append(delta.text)
            if logprobs is not None:
                logprobs.extend(delta)
            last = delta
    return CompletionResponse(id=job.request_id, model=req.model, choices=[CompletionChoice(
        text="".join(text), logprobs=logprobs.build() if logprobs else None,
        finish_reason=last.finish_reason)],
        usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens))


async def _stream(ctx: ServingContext, req: CompletionRequest, job: GenerationJob, first: TextDelta,
                  deltas: AsyncIterator[TextDelta]) -> AsyncIterator[str]:
    logprobs = _LogprobsBuilder(ctx) if req.logprobs is not None else None
    last = first
    async with aclosing(deltas):
        try:
            async for delta in chain(first, deltas):
                last = delta
                if delta.text or delta.finish_reason or delta.token_ids:
                    choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason,
                                              logprobs=logprobs.add(delta).build() if logprobs else None)
                    yield sse(CompletionResponse(id=job.request_id, model=req.model, choices=[choice]))
        except Exception as exc:
            yield sse_error(exc)
            yield SSE_DONE
            return
    if req.include_usage_in_stream():
        usage = Usage.of(last.num_prompt_tokens, last.num_output_tokens)
        yield sse(CompletionResponse(id=job.request_id, model=req.model, choices=[], usage=usage))
    yield SSE_DONE


class _LogprobsBuilder:
    """The legacy completions logprobs: parallel lists, one entry per generated token."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.offset = 0
        self.current = CompletionLogprobs()

    def add(self, delta: TextDelta) -> _LogprobsBuilder:
        """Start a new set of entries (streaming sends each delta's tokens on their own)."""
        self.current = CompletionLogprobs()
        return self.extend(delta)

    def extend(self, delta: TextDelta) -> _LogprobsBuilder:
        for token_id, sampled in zip(delta.token_ids, delta.logprobs, strict=True):
            token = self.ctx.token_text(token_id)
            self.current.tokens.append(token)
            self.current.token_logprobs.append(sampled.logprob)
            top = {self.ctx.token_text(t): lp for t, lp in sampled.top_logprobs or []}
            top.setdefault(token, sampled.logprob)
            self.current.top_logprobs.append(top)
            self.current.text_offset.append(self.offset)
            self.offset += len(token)
        return self

    def build(self) -> CompletionLogprobs:
        return self.current
