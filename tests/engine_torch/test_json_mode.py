"""JSON mode (`SamplingParams.json_object`): the sampler draws exactly from the masked,
renormalized distribution, forces EOS once the object is closed and gives up with NO_TOKEN when
nothing fits; on the tiny model every finished output is a JSON object, greedy or sampled, seeded
requests are reproducible, and requests beside constrained ones are unchanged."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from loraplex_agent.runtime.json_mode import TokenTexts
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.runtime.sampler import Sampler
from oracle_cases import prompts

from loraplex.engine.output.json_grammar import JsonPrefix
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import NO_TOKEN, FinishReason, Request

CPU = torch.device("cpu")
EOS = 1
# A toy vocabulary: 0 and 1 are special (no text), then a few JSON pieces and many invalid tokens.
TEXTS = ["", "", "{", "}", '"', '"a":1', " ", "{}", "x}", "]"] + ["x"] * 90


def sampler_with(texts: list[str]) -> Sampler:
    sampler = Sampler(CPU, seed=0)
    sampler.json.use_vocabulary(TokenTexts(texts, CPU))
    return sampler


def json_request(output: list[int], **params) -> Request:
    request = Request("r", [5], SamplingParams(json_object=True, **params), eos_token_ids=(EOS,))
    request.output_token_ids = list(output)
    return request


def test_draws_follow_the_masked_renormalized_distribution():
    """After `{` only `}`, `"`, `"a":1` and a blank fit; the invalid `x` tokens hold most of the
    mass (so the walk must go past its first tries), yet the draws follow p over the valid tokens."""
    logits = torch.full((1, len(TEXTS)), -1.0)
    logits[0, 10:] = 4.0  # invalid, and most likely
    logits[0, [3, 4, 6, 7]] = torch.tensor([0.5, 1.0, -0.5, 2.0])  # `{}` (7) cannot follow `{`
    request = json_request([2], temperature=1.0)
    sampler = sampler_with(TEXTS)
    draws = Counter(sampler(logits, [request.sampling], [step])[0].token_id for step in range(3000))
    valid = [3, 4, 5, 6]
    probs = torch.softmax(logits[0, valid], dim=-1).tolist()
    assert set(draws) == set(valid)
    for token, p in zip(valid, probs, strict=True):
        assert abs(draws[token] / 3000 - p) < 0.03, (token, draws[token] / 3000, p)


def test_greedy_takes_the_best_valid_token_and_seeds_reproduce():
    logits = torch.randn(1, len(TEXTS), generator=torch.Generator().manual_seed(1))
    logits[0, 10:] += 10.0
    greedy = json_request([], temperature=0.0).sampling
    expected = 2 if logits[0, 2] > logits[0, 7] else 7  # `{` or `{}`, whichever is better; never an `x`
    assert sampler_with(TEXTS)(logits, [greedy], [0])[0].token_id == expected
    seeded = json_request([2], temperature=1.0, seed=11).sampling
    draws = [sampler_with(TEXTS)(logits, [seeded], [3])[0].token_id for _ in range(3)]
    assert len(set(draws)) == 1


def test_a_narrow_top_p_falls_back_to_the_whole_vocabulary():
    logits = torch.full((1, len(TEXTS)), -5.0)
    logits[0, 10] = 10.0  # `x`: alone in the top-p set, and invalid
    request = json_request([2], temperature=1.0, top_p=0.1)
    assert sampler_with(TEXTS)(logits, [request.sampling], [0])[0].token_id in (3, 4, 5, 6)


def test_eos_is_forced_once_the_object_is_closed():
    logits = torch.zeros(1, len(TEXTS))
    logits[0, 6] = 50.0  # a blank would be most likely
    sampler = sampler_with(TEXTS)
    assert sampler(logits, [json_request([2, 3]).sampling], [2])[0].token_id == EOS
    assert sampler(logits, [json_request([7]).sampling], [1])[0].token_id == EOS


def test_no_token_when_nothing_fits():
    sampler = sampler_with(["", ""] + ["x"] * 20)
    [token] = sampler(torch.zeros(1, 22), [json_request([], temperature=0.0, logprobs=2).sampling], [0])
    assert token.token_id == NO_TOKEN and token.logprob is None


def test_a_stop_token_id_never_cuts_the_object_short():
    logits = torch.zeros(1, len(TEXTS))
    logits[0, 3] = 50.0  # `}` closes the object and is a stop token id: not before the object closes
    request = json_request([2, 4], temperature=0.0, stop_token_ids=(3,))  # `{"`: a key is under way
    token = sampler_with(TEXTS)(logits, [request.sampling], [2])[0].token_id
    assert token != 3 and JsonPrefix.start().feed('{"' + TEXTS[token]) is not None


# ---- the tiny model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=128, num_blocks=600,
              max_num_seqs=64, max_loras=2)
    llm.add_adapter("lora01-r16", tiny_model.adapters["lora01-r16"])
    return llm


def closer_bias(llm: LLM) -> dict[int, float]:
    """A push towards closing strings and objects, so that random weights finish some objects."""
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in ('"', '":', '",', "}", ' "', "1", "]")]
    return {token[0]: 6.0 for token in ids if len(token) == 1}


def check_outputs(llm: LLM, requests: list[Request]) -> Counter:
    reasons = Counter()
    for request in requests:
        text = llm.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        reasons[request.finish_reason] += 1
        if request.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict), text
        else:  # max_tokens: cut short, but still a prefix of an object
            assert request.finish_reason is FinishReason.LENGTH
            assert JsonPrefix.start().feed(text) is not None, text
    return reasons


def test_sampled_outputs_are_json_objects(llm):
    bias = closer_bias(llm)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=40, json_object=True,
                             logit_bias=bias) for seed in range(40)]
    batch = prompts([6] * 40, seed=4)
    requests = llm.generate(batch, params, [None, "lora01-r16"] * 20)
    reasons = check_outputs(llm, requests)
    assert reasons[FinishReason.STOP] >= 20
    longer = [r for r in requests if r.finish_reason is FinishReason.STOP and len(r.output_token_ids) > 3]
    assert longer  # objects with members, not only `{}`
    alone = llm.generate([batch[7]], params[7], ["lora01-r16"])[0]
    assert alone.output_token_ids == requests[7].output_token_ids  # seeded: the same alone as in the batch


def test_greedy_outputs_are_json_objects(llm):
    requests = llm.generate(prompts([5, 9, 13], seed=6), SamplingParams(temperature=0.0, max_tokens=30,
                                                                        json_object=True), [None] * 3)
    check_outputs(llm, requests)
    again = llm.generate(prompts([5, 9, 13], seed=6), SamplingParams(temperature=0.0, max_tokens=30,
                                                                     json_object=True), [None] * 3)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in requests]


def test_requests_beside_json_mode_are_unchanged(llm):
    batch = prompts([8, 11, 6, 9], seed=8)
    plain = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    alone = llm.generate(batch[:2], plain[:2], [None, "lora01-r16"])
    constrained = SamplingParams(temperature=1.0, max_tokens=12, json_object=True)
    mixed = llm.generate(batch, plain[:2] + [constrained] * 2, [None, "lora01-r16", None, None])
    assert [r.output_token_ids for r in mixed[:2]] == [r.output_token_ids for r in alone]


def test_min_tokens_past_the_object_keeps_the_text_an_object(llm):
    [request] = llm.generate(prompts([5], seed=9), SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25,
                                                                  json_object=True, logit_bias=closer_bias(llm)))
    text = llm.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    assert isinstance(json.loads(text), dict)
    assert request.output_token_ids[-1] in llm.eos_token_ids


def test_a_vocabulary_that_cannot_write_json_ends_with_length(tiny_model):
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=64, num_blocks=100)
    llm.executor.sampler.json.use_vocabulary(TokenTexts(["x"] * llm.model_config.vocab_size, CPU))
    [request] = llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=8, json_object=True))
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [NO_TOKEN]


def test_token_texts_are_what_the_detokenizer_writes(llm):
    tokenizer = llm.tokenizer
    texts = llm.executor.sampler.json.texts.texts
    assert len(texts) == llm.model_config.vocab_size
    assert all(texts[token] == "" for token in tokenizer.all_special_ids)  # EOS and friends: never text
    spaced = tokenizer.encode(' "', add_special_tokens=False)
    assert [texts[t] for t in spaced] == [tokenizer.decode(spaced)]  # a leading space is kept
    partial = [t for t, text in enumerate(texts) if "\ufffd" in text]
    assert partial  # bytes of a multi-byte character: they fit inside strings only
    state = JsonPrefix.start().feed('{"')
    assert all(state.feed(texts[t]) is not None for t in partial if '"' not in texts[t] and "\\" not in texts[t])
    assert all(JsonPrefix.start().feed("{").feed(texts[t]) is None for t in partial if texts[t][0] == "\ufffd")
