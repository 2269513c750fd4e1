"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template; `n` choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from loraplex_agent.api.generation import TextDelta
from loraplex_agent.api.openai_protocol import (
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
from loraplex_agent.api.serving import SSE_DONE, ServingContext, sse, sse_error
from loraplex_agent.api.serving_choices import Choices, sibling_jobs, start_choices


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest
                                 ) -> ChatCompletionResponse | AsyncIterator[str]:
    """The whole response, or (when `req.stream`) the SSE lines of the stream."""
    req.check_supported()
    adapter = ctx.resolve_model(req.model)
    prompt_ids = ctx.render_chat(req.messages)
    sampling = ctx.sampling_params(req, len(prompt_ids), req.max_new_tokens(), req.num_logprobs(), "messages",
                                   req.prompt_logprobs)
    request_id, jobs = sibling_jobs(ctx, "chatcmpl", prompt_ids, sampling, adapter, req.num_sequences)
    choices = await start_choices(ctx, request_id, jobs)
    if req.stream:
        return _stream(ctx, req, choices)
    return await _collect(ctx, req, choices)


async def _collect(ctx: ServingContext, req: ChatCompletionRequest, choices: Choices) -> ChatCompletionResponse:
    texts: list[list[str]] = [[] for _ in choices.jobs]
    logprobs = [ChatLogprobs() if req.logprobs else None for _ in choices.jobs]
    last = list(choices.firsts)
    async with aclosing(choices.deltas()) as deltas:
        async for index, delta in deltas:
            texts[index].append(delta.text)
            if logprobs[index] is not None:
                logprobs[index].content.extend(_token_logprobs(ctx, delta))
            last[index] = delta
    answers = [ChatChoice(index=i, message=AssistantMessage(content="".join(texts[i])), logprobs=logprobs[i],
                          finish_reason=last[i].finish_reason) for i in range(len(choices.jobs))]
    return ChatCompletionResponse(id=choices.request_id, model=req.model, choices=answers, usage=_usage(last),
                                  prompt_logprobs=ctx.prompt_logprobs(choices.firsts[0].prompt_logprobs))


def _usage(last: list[TextDelta]) -> Usage:
    """The prompt once (and its cached tokens, as the first choice found them), and the generated
    tokens of every choice."""
    return Usage.of(last[0].num_prompt_tokens, sum(delta.num_output_tokens for delta in last),
                    last[0].num_cached_tokens)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, choices: Choices) -> AsyncIterator[str]:
    def chunk(chunk_choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=choices.request_id, model=req.model, choices=chunk_choices,
                                       usage=usage))

    for index in range(len(choices.jobs)):
        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    last = list(choices.firsts)
    async with aclosing(choices.deltas()) as deltas:
        try:
            async for index, delta in deltas:
                last[index] = delta
                if delta.text or delta.finish_reason or delta.token_ids:
                    logprobs = ChatLogprobs(content=_token_logprobs(ctx, delta)) if req.logprobs else None
                    yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=delta.text),
                                                 logprobs=logprobs, finish_reason=delta.finish_reason)])
        except Exception as exc:
            yield sse_error(exc)
            yield SSE_DONE
            return
    if req.include_usage_in_stream():
        yield chunk([], _usage(last))
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
