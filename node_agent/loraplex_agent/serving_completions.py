"""POST /v1/completions: one prompt (text or token ids) in, `n` choices of text out, whole or streamed.

`best_of` generates that many sequences and returns the `n` with the highest cumulative logprob
(raw logprobs of every generated token). `echo` puts the prompt's text before each choice's text;
with `logprobs`, the prompt's tokens come first with a null logprob (prompt logprobs are not
computed: the engine samples the last row of a prefill only).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from loraplex_agent.generation import TextDelta
from loraplex_agent.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from loraplex_agent.serving import SSE_DONE, ServingContext, sse, sse_error
from loraplex_agent.serving_choices import Choices, sibling_jobs, start_choices


@dataclass
class _Echo:
    text: str
    token_ids: list[int]


async def create_completion(ctx: ServingContext, req: CompletionRequest
                            ) -> CompletionResponse | AsyncIterator[str]:
    """The whole response, or (when `req.stream`) the SSE lines of the stream."""
    req.check_supported()
    adapter = ctx.resolve_model(req.model)
    prompt = req.single_prompt()
    prompt_ids = ctx.tokenize(prompt)
    # best_of ranks by the sampled tokens' logprobs, so they are computed even when not asked for
    ranked = req.num_sequences > req.num_choices
    logprobs = 0 if ranked and req.logprobs is None else req.logprobs
    sampling = ctx.sampling_params(req, len(prompt_ids), req.max_tokens, logprobs, "prompt")
    request_id, jobs = sibling_jobs(ctx, "cmpl", prompt_ids, sampling, adapter, req.num_sequences)
    choices = await start_choices(ctx, request_id, jobs)
    echo = _Echo(prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids), prompt_ids) \
        if req.echo else None
    if req.stream:
        return _stream(ctx, req, choices, echo)
    return await _collect(ctx, req, choices, echo)


async def _collect(ctx: ServingContext, req: CompletionRequest, choices: Choices,
                   echo: _Echo | None) -> CompletionResponse:
    texts = [_ChoiceText(ctx, req.logprobs is not None, echo) for _ in choices.jobs]
    async with aclosing(choices.deltas()) as deltas:
        async for index, delta in deltas:
            texts[index].add(delta, fresh=False)
    best = _best(texts, req.num_choices)
    return CompletionResponse(id=choices.request_id, model=req.model,
                              choices=[text.choice(index) for index, text in enumerate(best)],
                              usage=_usage(texts))


def _best(texts: list[_ChoiceText], n: int) -> list[_ChoiceText]:
    """All choices in order, or (best_of > n) the n of highest cumulative logprob, best first."""
    if len(texts) == n:
        return texts
    return sorted(texts, key=lambda t: t.last.cumulative_logprob, reverse=True)[:n]


def _usage(texts: list[_ChoiceText]) -> Usage:
    """The prompt once, and every generated token of every sequence (best_of's discarded ones too)."""
    return Usage.of(texts[0].last.num_prompt_tokens, sum(t.last.num_output_tokens for t in texts))


async def _stream(ctx: ServingContext, req: CompletionRequest, choices: Choices,
                  echo: _Echo | None) -> AsyncIterator[str]:
    texts = [_ChoiceText(ctx, req.logprobs is not None, echo) for _ in choices.jobs]
    async with aclosing(choices.deltas()) as deltas:
        try:
            async for index, delta in deltas:
                text, logprobs = texts[index].add(delta, fresh=True)
                if text or delta.finish_reason or delta.token_ids:
                    choice = CompletionChoice(index=index, text=text, finish_reason=delta.finish_reason,
                                              logprobs=logprobs)
                    yield sse(CompletionResponse(id=choices.request_id, model=req.model, choices=[choice]))
        except Exception as exc:
            yield sse_error(exc)
            yield SSE_DONE
            return
    if req.include_usage_in_stream():
        yield sse(CompletionResponse(id=choices.request_id, model=req.model, choices=[], usage=_usage(texts)))
    yield SSE_DONE


class _ChoiceText:
    """One choice: its text and logprobs, whole or per streamed delta; the echoed prompt goes first."""

    def __init__(self, ctx: ServingContext, logprobs: bool, echo: _Echo | None) -> None:
        self.logprobs = _LogprobsBuilder(ctx) if logprobs else None
        self.echo = echo  # still to be sent
        self.parts: list[str] = []
        self.last = TextDelta("", [], [], None, 0, 0)

    def add(self, delta: TextDelta, fresh: bool) -> tuple[str, CompletionLogprobs | None]:
        """Take `delta` in; the text and (with `fresh`, only its own) logprobs it adds."""
        text = delta.text
        if self.logprobs is not None and fresh:
            self.logprobs.restart()
        if self.echo is not None:
            text = self.echo.text + text
            if self.logprobs is not None:
                self.logprobs.extend_prompt(self.echo.token_ids)
                self.logprobs.offset = len(self.echo.text)  # generated tokens' offsets point into the text
            self.echo = None
        if self.logprobs is not None:
            self.logprobs.extend(delta)
        self.parts.append(text)
        self.last = delta
        return text, self.logprobs.current if self.logprobs is not None else None

    def choice(self, index: int) -> CompletionChoice:
        return CompletionChoice(index=index, text="".join(self.parts), finish_reason=self.last.finish_reason,
                                logprobs=self.logprobs.current if self.logprobs is not None else None)


class _LogprobsBuilder:
    """The legacy completions logprobs: parallel lists, one entry per token."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.offset = 0
        self.current = CompletionLogprobs()

    def restart(self) -> None:
        """Start a new set of entries (streaming sends each delta's tokens on their own)."""
        self.current = CompletionLogprobs()

    def extend_prompt(self, token_ids: list[int]) -> None:
        """Echoed prompt tokens: their text, no logprob."""
        for token_id in token_ids:
            self._entry(self.ctx.token_text(token_id), None, None)

    def extend(self, delta: TextDelta) -> None:
        for token_id, sampled in zip(delta.token_ids, delta.logprobs, strict=True):
            token = self.ctx.token_text(token_id)
            top = {self.ctx.token_text(t): lp for t, lp in sampled.top_logprobs or []}
            top.setdefault(token, sampled.logprob)
            self._entry(token, sampled.logprob, top)

    def _entry(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.current.tokens.append(token)
        self.current.token_logprobs.append(logprob)
        self.current.top_logprobs.append(top)
        self.current.text_offset.append(self.offset)
        self.offset += len(token)
