"""POST /v1/completions: one prompt (text or token ids) in, `n` choices of text out, whole or streamed.

`best_of` generates that many sequences and returns the `n` with the highest cumulative logprob
(raw logprobs of every generated token). `echo` puts the prompt's text before each choice's text;
with `logprobs`, the prompt's tokens come first, each with its logprob given the tokens before it
(the first one's null), computed by the engine over every prompt position (`prompt_logprobs`).
vLLM's `prompt_logprobs` parameter also gives them, in vLLM's shape, in each choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from loraplex.engine.request import SampledToken
from loraplex_agent.api.generation import TextDelta
from loraplex_agent.api.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from loraplex_agent.api.serving import SSE_DONE, ServingContext, sse, sse_error
from loraplex_agent.api.serving_choices import Choices, sibling_jobs, start_choices


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
    sampling = ctx.sampling_params(req, len(prompt_ids), req.max_tokens, logprobs, "prompt",
                                   req.num_prompt_logprobs())
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
    answers = [text.choice(index, req.prompt_logprobs is not None) for index, text in enumerate(best)]
    return CompletionResponse(id=choices.request_id, model=req.model, choices=answers, usage=_usage(texts))


def _best(texts: list[_ChoiceText], n: int) -> list[_ChoiceText]:
    """All choices in order, or (best_of > n) the n of highest cumulative logprob, best first."""
    if len(texts) == n:
        return texts
    return sorted(texts, key=lambda t: t.last.cumulative_logprob, reverse=True)[:n]


def _usage(texts: list[_ChoiceText]) -> Usage:
    """The prompt once (and its cached tokens, as the first sequence found them), and every
    generated token of every sequence (best_of's discarded ones too)."""
    return Usage.of(texts[0].last.num_prompt_tokens, sum(t.last.num_output_tokens for t in texts),
                    texts[0].last.num_cached_tokens)


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
        self.ctx = ctx
        self.logprobs = _LogprobsBuilder(ctx) if logprobs else None
        self.echo = echo  # still to be sent
        self.parts: list[str] = []
        self.last = TextDelta("", [], [], None, 0, 0)
        self.prompt_logprobs: list[SampledToken | None] | None = None  # from the first delta

    def add(self, delta: TextDelta, fresh: bool) -> tuple[str, CompletionLogprobs | None]:
        """Take `delta` in; the text and (with `fresh`, only its own) logprobs it adds."""
        text = delta.text
        if self.logprobs is not None and fresh:
            self.logprobs.restart()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.echo is not None:
            text = self.echo.text + text
            if self.logprobs is not None:
                self.logprobs.extend_prompt(self.echo.token_ids, delta.prompt_logprobs)
                self.logprobs.offset = len(self.echo.text)  # generated tokens' offsets point into the text
            self.echo = None
        if self.logprobs is not None:
            self.logprobs.extend(delta)
        self.parts.append(text)
        self.last = delta
        return text, self.logprobs.current if self.logprobs is not None else None

    def choice(self, index: int, prompt_logprobs: bool) -> CompletionChoice:
        """The whole choice; with `prompt_logprobs`, vLLM's list of them too."""
        return CompletionChoice(index=index, text="".join(self.parts), finish_reason=self.last.finish_reason,
                                logprobs=self.logprobs.current if self.logprobs is not None else None,
                                prompt_logprobs=self.ctx.prompt_logprobs(self.prompt_logprobs) if prompt_logprobs else None)


class _LogprobsBuilder:
    """The legacy completions logprobs: parallel lists, one entry per token."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.offset = 0
        self.current = CompletionLogprobs()

    def restart(self) -> None:
        """Start a new set of entries (streaming sends each delta's tokens on their own)."""
        self.current = CompletionLogprobs()

    def extend_prompt(self, token_ids: list[int], scored: list[SampledToken | None] | None) -> None:
        """Echoed prompt tokens: their text and their logprobs (none for the first token, which
        nothing predicts, nor where the engine gave none)."""
        for token_id, entry in zip(token_ids, scored or [None] * len(token_ids), strict=True):
            if entry is None:
                self._entry(self.ctx.token_text(token_id), None, None)
            else:
                self._scored(token_id, entry)

    def extend(self, delta: TextDelta) -> None:
        for token_id, sampled in zip(delta.token_ids, delta.logprobs, strict=True):
            self._scored(token_id, sampled)

    def _scored(self, token_id: int, scored: SampledToken) -> None:
        """A token with its logprob; its top alternatives (by text) hold it too."""
        token = self.ctx.token_text(token_id)
        top = {self.ctx.token_text(t): lp for t, lp in scored.top_logprobs or []}
        top.setdefault(token, scored.logprob)
        self._entry(token, scored.logprob, top)

    def _entry(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.current.tokens.append(token)
        self.current.token_logprobs.append(logprob)
        self.current.top_logprobs.append(top)
        self.current.text_offset.append(self.offset)
        self.offset += len(token)
