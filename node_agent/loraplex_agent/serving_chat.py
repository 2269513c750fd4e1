"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from loraplex_agent.generation import GenerationJob, TextDelta
from loraplex_agent.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from loraplex_agent.serving import SSE_DONE, ServingContext, chain, sse, sse_error


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest
                                 ) -> ChatCompletionResponse | AsyncIterator[str]:
    """The whole response, or (when `req.stream`) the SSE lines of the stream."""
    req.check_supported()
    adapter = ctx.resolve_model(req.model)
    prompt_ids = ctx.render_chat(req.messages)
    sampling = ctx.sampling_params(req, len(prompt_ids), req.max_new_tokens(), req.num_logprobs(), "messages")
    job = ctx.job("chatcmpl", prompt_ids, sampling, adapter)
    first, deltas = await ctx.start(job)
    if req.stream:
        return _stream(ctx, req, job, first, deltas)
    return await _collect(ctx, req, job, first, deltas)


async def _collect(ctx: ServingContext, req: ChatCompletionRequest, job: GenerationJob, first: TextDelta,
                   deltas: AsyncIterator[TextDelta]) -> ChatCompletionResponse:
    logprobs = ChatLogprobs() if req.logprobs else None
    text, last = [], first
    async with aclosing(deltas):
        async for delta in chain(first, deltas):
            text.append(delta.text)
            if logprobs is not None:
                logprobs.content.extend(_token_logprobs(ctx, delta))
            last = delta
    choice = ChatChoice(message=AssistantMessage(content="".join(text)), logprobs=logprobs,
                        finish_reason=last.finish_reason)
    return ChatCompletionResponse(id=job.request_id, model=req.model, choices=[choice],
                                  usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens))


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, job: GenerationJob, first: TextDelta,
                  deltas: AsyncIterator[TextDelta]) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=job.request_id, model=req.model, choices=choices, usage=usage))

    yield chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
    last = first
    async with aclosing(deltas):
        try:
            async for delta in chain(first, deltas):
                last = delta
                if delta.text or delta.finish_reason or delta.token_ids:
                    logprobs = ChatLogprobs(content=_token_logprobs(ctx, delta)) if req.logprobs else None
                    yield chunk([ChatChunkChoice(delta=DeltaMessage(content=delta.text), logprobs=logprobs,
                                                 finish_reason=delta.finish_reason)])
        except Exception as exc:
            yield sse_error(exc)
            yield SSE_DONE
            return
    if req.include_usage_in_stream():
        yield chunk([], Usage.of(last.num_prompt_tokens, last.num_output_tokens))
    yield SSE_DONE


def _token_logprobs(ctx: ServingContext, delta: TextDelta) -> list[TokenLogprob]:
    entries = []
    for token_id, sampled in zip(delta.token_ids, delta.logprobs, strict=True):
        top = [_top(ctx.token_text(t), lp) for t, lp in sampled.top_logprobs or []]
        token = ctx.token_text(token_id)
        entries.append(TokenLogprob(token=token, logprob=sampled.logprob, bytes=list(token.encode()),
                                    top_logprobs=top))
    return entries


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
