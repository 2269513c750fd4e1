"""Logit bias and penalties: the sampler against HF's logits processors (repetition penalty, sequence
bias) and OpenAI's presence / frequency definition, per row of a mixed batch; then the engine on the
tiny model (fp32, greedy) against the HF + peft oracle, and a penalised request beside a plain one."""

from __future__ import annotations

import gc

import pytest
import torch
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.runtime.sampler import Sampler, TokenTensors, adjust
from oracle_cases import prompts
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.spec.errors import InvalidRequestError

CPU = torch.device("cpu")
VOCAB = 64


def _request(prompt: list[int], output: list[int], **params) -> Request:
    request = Request("r", prompt, SamplingParams(**{"temperature": 0.0, **params}))
    request.output_token_ids.extend(output)
    return request


def _hf_expected(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """One row through HF's processors (bias, repetition) and OpenAI's presence / frequency formula."""
    p = request.sampling
    row = logits.unsqueeze(0)
    if p.logit_bias:
        row = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(torch.tensor([[0]]), row)
    ids = torch.tensor([request.all_token_ids])
    row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long), minlength=VOCAB).float()
    return row[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_adjusted_rows_match_hf_processors_and_plain_rows_stay_raw():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    requests = [
        _request([3, 5, 5, 9], [9, 12, 12, 12], repetition_penalty=1.7),
        _request([1, 2], [7]),  # nothing to adjust
        _request([4, 4, 8], [8, 8, 30, 31, 30], presence_penalty=0.6, frequency_penalty=-0.4,
                 repetition_penalty=0.8, logit_bias={30: -5.0, 2: 3.5, 63: 100.0}),
        _request([6], [6, 6, 6], frequency_penalty=1.5, logit_bias={0: -100}),
    ]
    adjusted = adjust(logits, [r.sampling for r in requests], TokenTensors(CPU))
    for row, request in enumerate(requests):
        if not request.sampling.adjusts_logits:
            assert torch.equal(adjusted[row], logits[row])
            continue
        torch.testing.assert_close(adjusted[row], _hf_expected(logits[row], request), rtol=0, atol=1e-6)


def test_greedy_picks_the_argmax_of_the_adjusted_logits_and_logprobs_stay_raw():
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    request = _request([1], [10], presence_penalty=2.0, logprobs=0)
    [token] = Sampler(CPU, seed=0)(logits, [request.sampling], [1])
    assert token.token_id == 11  # 5 - 2 < 4
    assert token.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[11].item())


def test_token_copies_follow_the_output_and_leave_with_the_request():
    tokens = TokenTensors(CPU)
    request = _request([5, 3, 5], [1], repetition_penalty=1.2)
    assert tokens.prompt(request).tolist() == [3, 5]
    assert tokens.output(request).tolist() == [1]
    request.output_token_ids.extend([2, 2])
    assert tokens.output(request).tolist() == [1, 2, 2]
    assert len(tokens) == 1
    del request
    gc.collect()
    assert len(tokens) == 0


def test_requests_get_their_own_bound_parameters():
    shared = SamplingParams(frequency_penalty=0.5, logit_bias={7: 1.0})
    a, b = Request("a", [1], shared), Request("b", [2], shared)
    assert a.sampling.history is a and b.sampling.history is b
    assert a.sampling == shared and hash(a.sampling) == hash(shared)
    assert Request("c", [1], SamplingParams()).sampling.history is None  # nothing to read: not bound


@pytest.mark.parametrize(("params", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
])
def test_bad_values_are_refused_naming_the_parameter(params, param):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**params)
    assert raised.value.param == param


# ---- the engine on the tiny model against the HF + peft oracle ---------------------------------------

ADAPTER = "lora01-r16"
PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={17: 9.0, 40: -100.0},
                   repetition_penalty=0.7, frequency_penalty=-0.5),
]
PLAIN = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=128, num_blocks=400, max_loras=2)
    llm.add_adapter(ADAPTER, tiny_model.adapters[ADAPTER])
    llm.executor.capture_logits = True
    return llm


def _repetitive_prompts() -> list[list[int]]:
    return [p * 3 for p in prompts([5, 4, 6], seed=3)]  # repeated tokens: the penalties have work to do


def test_penalised_greedy_tokens_match_hf_processors_over_the_oracle(llm, hf_oracle):
    requests = llm.generate(_repetitive_prompts(), PENALISED, [ADAPTER, None, ADAPTER])
    for request in requests:
        adapter = request.adapter.name if request.adapter else None
        tokens = request.all_token_ids
        oracle = hf_oracle.logits(tokens, adapter)[request.num_prompt_tokens - 1:-1]
        ours = torch.stack(llm.executor.captured_logits[request.request_id])
        assert (ours - oracle).abs().max().item() <= 1e-4  # the raw logits: the model itself
        for step, token in enumerate(request.output_token_ids):
            history = _request(request.prompt_token_ids, request.output_token_ids[:step])
            history.sampling = request.sampling
            assert _hf_argmax(oracle[step], history) == token, (request.request_id, step)


def _hf_argmax(logits: torch.Tensor, request: Request) -> int:
    p = request.sampling
    row = logits.unsqueeze(0)
    if p.logit_bias:
        row = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(torch.tensor([[0]]), row)
    row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([request.all_token_ids]), row)[0]
    counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long),
                            minlength=row.shape[-1]).float()
    return int((row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()).argmax())


def test_penalties_change_the_output_and_stay_within_their_request(llm):
    prompt_list = _repetitive_prompts()
    adapters = [ADAPTER, None, ADAPTER]
    plain = llm.generate(prompt_list, PLAIN, adapters)
    assert any(r.output_token_ids != p.output_token_ids
               for r, p in zip(llm.generate(prompt_list, PENALISED, adapters), plain, strict=True))
    # one batch: penalised and plain requests of the same prompts side by side, each as when alone
    mixed = llm.generate(prompt_list * 2, [*PENALISED, PLAIN, PLAIN, PLAIN], adapters * 2)
    for i, (params, prompt, adapter) in enumerate(zip(PENALISED, prompt_list, adapters, strict=True)):
        [alone] = llm.generate([prompt], params, [adapter])
        assert mixed[i].output_token_ids == alone.output_token_ids
        assert mixed[i + 3].output_token_ids == plain[i].output_token_ids
