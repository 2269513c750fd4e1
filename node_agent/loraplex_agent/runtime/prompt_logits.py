"""Prompt logprobs in the executor: the log-softmax at every prompt position of a request that asks
(`SamplingParams.prompt_logprobs`; `/v1/completions` with `echo` and `logprobs`).

A prefill chunk's row at position p predicts the prompt token at p + 1, so a chunk covering
positions s..s+n-1 yields the logprobs of the prompt tokens at s+1..s+n (the last row of the last
chunk predicts the first generated token instead). The targets come from the request's prompt
(`SamplingParams.history`), so the last row of a chunk is scored against the first token of the
next chunk. The head runs on these rows apart from the sampled rows, which keeps the sampled rows'
logits bit for bit what they are without prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.engine.messages import PromptLogprobs, ScheduledChunk
from loraplex.engine.request import SampledToken

if TYPE_CHECKING:
    from loraplex_agent.runtime.model.llama import LlamaModel

ROWS_AT_ONCE = 128  # rows per log-softmax over the vocabulary: bounds the memory of a long chunk


@dataclass
class PromptRows:
    """The rows of one chunk whose logprobs are wanted, and the prompt tokens they predict."""

    request_id: str
    first_row: int  # the step's row of the chunk's first token
    first_position: int  # the position of the first predicted token (the chunk's start + 1)
    targets: list[int]  # one per row, from the chunk's first row on
    num_top: int

    @classmethod
    def of(cls, chunk: ScheduledChunk, first_row: int) -> PromptRows | None:
        """The rows of a prefill chunk of a request that wants its prompt logprobs, else None. A
        one-token prompt predicts none: its empty share still says the list is there (`[None]`)."""
        num_top = chunk.sampling.prompt_logprobs
        if num_top is None or chunk.num_output_tokens:
            return None  # not asked, or handed out already (a preempted request recomputing)
        history = chunk.sampling.history
        if history is None:
            raise ValueError("prompt logprobs need the request's prompt: build the Request with these parameters")
        start = chunk.start_position
        targets = history.prompt_token_ids[start + 1:start + 1 + chunk.num_tokens]
        return cls(chunk.request_id, first_row, start + 1, targets, num_top)


def prompt_logprobs(model: LlamaModel, hidden: torch.Tensor, wanted: list[PromptRows]) -> dict[str, PromptLogprobs]:
    """Each chunk's share, from the step's last hidden states."""
    return {rows.request_id: PromptLogprobs(rows.first_position, _tokens(model, hidden, rows)) for rows in wanted}


def _tokens(model: LlamaModel, hidden: torch.Tensor, rows: PromptRows) -> list[SampledToken]:
    tokens: list[SampledToken] = []
    for begin in range(0, len(rows.targets), ROWS_AT_ONCE):
        targets = rows.targets[begin:begin + ROWS_AT_ONCE]
        index = torch.arange(rows.first_row + begin, rows.first_row + begin + len(targets), device=hidden.device)
        logprobs = torch.log_softmax(model.logits(hidden, index), dim=-1)
        tokens.extend(_scored(logprobs, targets, rows.num_top))
    return tokens


def _scored(logprobs: torch.Tensor, targets: list[int], num_top: int) -> list[SampledToken]:
    """Each row's target: its logprob, its rank (1 + the tokens more likely) and the top `num_top`."""
    ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    tops: list[list[tuple[int, float]] | None] = [None] * len(targets)
    if num_top:
        values, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return [SampledToken(token, logprob, top, rank)
            for token, logprob, top, rank in zip(targets, chosen.squeeze(1).tolist(), tops, ranks, strict=True)]
