"""Prompt logprobs gathered across prefill chunks: shares by position (a recomputed chunk replaces
its first share), the whole list with the first token, nothing left behind by an abort."""

from __future__ import annotations

from loraplex.engine.messages import PromptLogprobs, RequestOutput
from loraplex.engine.output.prompt_logprobs import PromptLogprobsCollector
from loraplex.engine.request import SampledToken


def share(first: int, ids: list[int], logprob: float = -1.0) -> PromptLogprobs:
    return PromptLogprobs(first, [SampledToken(i, logprob) for i in ids])


def first_token(request_id: str, num_prompt: int) -> RequestOutput:
    return RequestOutput(request_id, [9], [SampledToken(9)], num_prompt, 1)


def test_chunks_are_joined_and_handed_out_with_the_first_token():
    collector = PromptLogprobsCollector()
    collector.update({"a": share(1, [11, 12])}, [], [])
    assert collector
    collector.update({"a": share(1, [11], logprob=-2.0)}, [], [])  # preempted, recomputed
    output = first_token("a", 5)
    collector.update({"a": share(3, [13, 14])}, [output], [])
    assert [e and (e.token_id, e.logprob) for e in output.prompt_logprobs] == \
        [None, (11, -2.0), (12, -1.0), (13, -1.0), (14, -1.0)]
    assert not collector


def test_later_tokens_and_other_requests_get_nothing():
    collector = PromptLogprobsCollector()
    later = RequestOutput("a", [9], [SampledToken(9)], 3, 2)
    other = first_token("b", 3)
    collector.update({"a": share(1, [11, 12])}, [later, other], [])
    assert later.prompt_logprobs is None and other.prompt_logprobs is None
    assert collector


def test_an_aborted_request_leaves_nothing_behind():
    collector = PromptLogprobsCollector()
    collector.update({"a": share(1, [11])}, [], [])
    collector.update({}, [], ["a"])
    assert not collector
