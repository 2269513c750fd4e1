"""Prompt logprobs gathered across the prefill chunks of a request, handed out with its first token.

The executor returns each chunk's share (`ExecutorResult.prompt_logprobs`); a long prompt comes
in several chunks (chunked prefill) and a request preempted before its first token computes some
again. Shares are keyed by position, so a recomputed one replaces the first. The whole list goes
out with the request's first `RequestOutput`, which comes from the step of its last prompt chunk.
"""

from __future__ import annotations

from loraplex.engine.messages import PromptLogprobs, RequestOutput
from loraplex.engine.request import SampledToken


class PromptLogprobsCollector:
    def __init__(self) -> None:
        self._pending: dict[str, dict[int, SampledToken]] = {}  # request_id -> position -> entry

    def __bool__(self) -> bool:
        return bool(self._pending)

    def update(self, shares: dict[str, PromptLogprobs], outputs: list[RequestOutput],
               finished_request_ids: list[str]) -> None:
        """Take this step's shares in, attach the complete lists to first tokens, and forget the
        requests that finished (an abort before the first token leaves its shares behind)."""
        for request_id in finished_request_ids:
            self._pending.pop(request_id, None)
        for request_id, share in shares.items():
            entries = self._pending.setdefault(request_id, {})
            for offset, token in enumerate(share.tokens):
                entries[share.first_position + offset] = token
        for output in outputs:
            if output.num_output_tokens == 1 and output.request_id in self._pending:
                output.prompt_logprobs = self._complete(output.request_id, output.num_prompt_tokens)

    def _complete(self, request_id: str, num_prompt_tokens: int) -> list[SampledToken | None]:
        entries = self._pending.pop(request_id)
        return [None] + [entries.get(position) for position in range(1, num_prompt_tokens)]
