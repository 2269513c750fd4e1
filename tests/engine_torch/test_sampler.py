"""Sampler: greedy, seeds, top-k / top-p support, logprobs."""

from __future__ import annotations

import math

import torch
from loraplex_agent.runtime.sampler import Sampler, restrict

from loraplex.engine.output.sampling import SamplingParams

CPU = torch.device("cpu")
VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax():
    logits = random_logits(4)
    tokens = Sampler(CPU, seed=0)(logits, [SamplingParams(temperature=0.0)] * 4, [0] * 4)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_seeded_row_is_independent_of_batch_and_sampler():
    logits = random_logits(3)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(CPU, seed=1)(logits[1:2], [seeded], [5])[0].token_id
    params = [SamplingParams(temperature=0.8), seeded, SamplingParams(temperature=0.0)]
    for sampler_seed in (2, 3, None):
        batch = Sampler(CPU, seed=sampler_seed)(logits, params, [0, 5, 9])
        assert batch[1].token_id == alone
    draws = {Sampler(CPU)(logits[1:2], [seeded], [step])[0].token_id for step in range(40)}
    assert len(draws) > 1  # the step number feeds the seed: not the same token every step


def test_top_k_and_top_p_restrict_the_support():
    logits = random_logits(1, seed=3)
    order = logits[0].argsort(descending=True).tolist()
    sampler = Sampler(CPU, seed=0)
    top_k = SamplingParams(temperature=1.5, top_k=3)
    assert {sampler(logits, [top_k], [s])[0].token_id for s in range(200)} <= set(order[:3])
    probs = torch.softmax(logits[0] / 1.5, -1)[order]
    needed = int((probs.cumsum(0) < 0.6).sum()) + 1  # smallest top set with mass >= 0.6
    top_p = SamplingParams(temperature=1.5, top_p=0.6)
    kept = torch.isfinite(restrict(logits, [top_p])[0]).nonzero().flatten().tolist()
    assert sorted(kept) == sorted(order[:needed])
    assert {sampler(logits, [top_p], [s])[0].token_id for s in range(200)} <= set(order[:needed])


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(2)
    params = [SamplingParams(temperature=0.7, logprobs=3, seed=1), SamplingParams(temperature=0.0, logprobs=0)]
    tokens = Sampler(CPU, seed=0)(logits, params, [0, 0])
    expected = torch.log_softmax(logits, -1)
    for row, token in enumerate(tokens):
        assert math.isclose(token.logprob, expected[row, token.token_id].item(), abs_tol=1e-6)
    values, ids = expected[0].topk(3)
    assert [i for i, _ in tokens[0].top_logprobs] == ids.tolist()
    assert all(math.isclose(lp, v, abs_tol=1e-6) for (_, lp), v in zip(tokens[0].top_logprobs, values.tolist(), strict=True))
    assert tokens[1].top_logprobs is None
    assert Sampler(CPU)(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])[0].logprob is None
