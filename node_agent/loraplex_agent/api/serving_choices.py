"""The choices of one request (`n`, `best_of`): sibling jobs, one shared prefill, merged streams.

Siblings share the prompt's KV blocks through the prefix cache. When the memory policy keeps one
and the prompt fills at least one block before its last token, a one-token request prefills the
prompt first; when it leaves the batch its full blocks join the dependency tree, and every sibling
then starts from them (`PagedMemory.begin` matches the chain), computing only the prompt's last,
partial block. Without a prefix cache (`--memory-policy no-cache`, `--no-prefix-cache`) the
siblings start at once and each computes the prompt. Sibling i samples with `seed + i` when a seed
is given, so every choice is reproducible and equals a single request sent with that seed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex_agent.api.generation import GenerationJob, TextDelta, generate_text
from loraplex_agent.api.serving import ServingContext
from loraplex_agent.runtime.async_engine import AsyncEngine

T = TypeVar("T")
_END = object()  # what `_next` returns at the end of an iterator


@dataclass
class Choices:
    """Started siblings: each one's first delta (so a refusal still gets its HTTP status) and the rest."""

    request_id: str  # the response's id
    jobs: list[GenerationJob]
    firsts: list[TextDelta]
    rests: list[AsyncGenerator[TextDelta, None]]

    def deltas(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """(choice index, delta) in the order the engine produces them; closing it aborts the rest."""
        return merge(self.firsts, self.rests)


def sibling_jobs(ctx: ServingContext, prefix: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 adapter: str | None, count: int) -> tuple[str, list[GenerationJob]]:
    """The response's id and `count` jobs of one prompt; with more than one, job i is `<id>-i` and
    samples with seed + i."""
    job = ctx.job(prefix, prompt_token_ids, sampling, adapter)
    if count == 1:
        return job.request_id, [job]
    return job.request_id, [replace(job, request_id=f"{job.request_id}-{i}", sampling=sibling_sampling(sampling, i))
                            for i in range(count)]


def sibling_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)


async def start_choices(ctx: ServingContext, request_id: str, jobs: list[GenerationJob]) -> Choices:
    """Prefill the prompt once when siblings can share it, then start every sibling together.
    Siblings that want prompt logprobs each compute the prompt: a cached prefix has no logits."""
    sharing = jobs[0].sampling.prompt_logprobs is None and ctx.shares_prefill(len(jobs[0].prompt_token_ids))
    if len(jobs) > 1 and sharing:
        await prefill_once(ctx.engine, jobs[0], f"{request_id}-prefill")
    streams = [generate_text(ctx.engine, ctx.tokenizer, ctx.metrics, job) for job in jobs]
    firsts = await first_of_each(streams)
    return Choices(request_id, jobs, firsts, streams)


async def prefill_once(engine: AsyncEngine, job: GenerationJob, request_id: str) -> None:
    """Compute `job`'s prompt in a one-token request; its full blocks are cached when it finishes."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    request = Request(request_id, list(job.prompt_token_ids), sampling, eos_token_ids=job.eos_token_ids)
    async with aclosing(engine.generate(request, job.adapter)) as outputs:
        async for _ in outputs:
            pass


async def first_of_each(streams: list[AsyncGenerator[TextDelta, None]]) -> list[TextDelta]:
    """The first delta of every stream, awaited together (all are submitted at once); on any
    failure every stream is closed, which aborts its request."""
    tasks = [asyncio.ensure_future(_first(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await _cancel(tasks)
        for stream in streams:
            await stream.aclose()
        raise


async def merge(firsts: list[T], rests: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """The firsts, then each iterator's items as they arrive, tagged with the iterator's index."""
    for index, first in enumerate(firsts):
        yield index, first
    pending = {asyncio.ensure_future(_next(rest)): i for i, rest in enumerate(rests)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                item = task.result()
                if item is _END:
                    continue
                yield index, item
                pending[asyncio.ensure_future(_next(rests[index]))] = index
    finally:
        await _cancel(list(pending))
        for rest in rests:
            await rest.aclose()


async def _first(stream: AsyncIterator[TextDelta]) -> TextDelta:
    return await anext(stream)


async def _next(iterator: AsyncIterator[T]) -> T | object:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return _END


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until they are over, so their iterators may be closed."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
