"""Activated LoRA against HF transformers + peft (fp32, CPU): the adapter's delta applies from the
last occurrence of its invocation in the prompt on, and on every generated token; a prompt without
it runs the base model. Invocations at a block boundary, mid-block, repeated and absent, in one
mixed batch with standard-LoRA and base requests, through chunked prefill, preemption, the
prefix cache (the conversation's KV computed by a base request) and every CPU LoRA backend."""

from __future__ import annotations

import pytest
import torch
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.tools.tiny_model import invocation_tokens
from oracle_cases import GREEDY, prompts

from loraplex.spec.alora import ADAPTER_NEVER, invocation_start

BLOCK = 16
ADAPTERS = ("lora00-r8", "alora00-r8", "alora01-r16")


class ALoraOracle:
    """peft's mixed-adapter model; an aLoRA row gets the offsets PEFT's `generate` computes from its
    prompt (the tokens from the invocation's start to the end of the sequence)."""

    def __init__(self, tiny) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(tiny.base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, tiny.adapters[ADAPTERS[0]], adapter_name=ADAPTERS[0])
        for name in ADAPTERS[1:]:
            model.load_adapter(tiny.adapters[name], adapter_name=name)
        self.model = model.eval()

    @torch.inference_mode()
    def logits(self, prompt: list[int], output: list[int], adapter: str | None) -> torch.Tensor:
        tokens = prompt + output
        extra = {}
        if adapter is not None and adapter.startswith("alora"):
            start = invocation_start(prompt, self.model.peft_config[adapter].alora_invocation_tokens)
            extra["alora_offsets"] = [None if start is None else len(tokens) - start]
        out = self.model(input_ids=torch.tensor([tokens]), adapter_names=[adapter or "__base__"], **extra)
        return out.logits[0].float()


@pytest.fixture(scope="module")
def oracle(tiny_alora_model) -> ALoraOracle:
    return ALoraOracle(tiny_alora_model)


@pytest.fixture(scope="module")
def invocation(tiny_alora_model) -> list[int]:
    return invocation_tokens(tiny_alora_model.base_dir)


def with_invocations(prompt: list[int], invocation: list[int], *starts: int) -> list[int]:
    prompt = list(prompt)
    for start in starts:
        prompt[start:start + len(invocation)] = invocation
    return prompt


def cases(invocation: list[int]) -> dict[str, tuple[list[int], str | None]]:
    p = prompts([40, 41, 45, 37, 30, 33, 44], seed=7)
    return {
        "block-boundary": (with_invocations(p[0], invocation, BLOCK), "alora00-r8"),
        "mid-block": (with_invocations(p[1], invocation, BLOCK + 5), "alora01-r16"),
        "repeated": (with_invocations(p[2], invocation, 3, 2 * BLOCK + 2), "alora00-r8"),
        "absent": (p[3], "alora01-r16"),
        "at-the-end": (with_invocations(p[4], invocation, 30 - len(invocation)), "alora00-r8"),
        "standard-lora": (with_invocations(p[5], invocation, 10), "lora00-r8"),
        "base": (with_invocations(p[6], invocation, 12), None),
    }


def make_llm(tiny, **engine) -> LLM:
    llm = LLM(tiny.base_dir, dtype="float32", device="cpu", **{"max_model_len": 128, "max_loras": 4, **engine})
    for name in ADAPTERS:
        llm.add_adapter(name, tiny.adapters[name])
    llm.executor.capture_logits = True
    return llm


def check(llm: LLM, requests, oracle: ALoraOracle, atol: float = 1e-4) -> None:
    for request in requests:
        adapter = request.adapter.name if request.adapter else None
        expected = oracle.logits(request.prompt_token_ids, request.output_token_ids, adapter)
        expected = expected[request.num_prompt_tokens - 1:-1]
        ours = torch.stack(llm.executor.captured_logits[request.request_id])
        diff = (ours - expected).abs().max().item()
        assert diff <= atol, f"{request.request_id} ({adapter}): max |logit diff| {diff}"
        assert expected.argmax(-1).tolist() == request.output_token_ids, request.request_id


ENGINES = {
    "one-batch": dict(num_blocks=300),
    "chunked-prefill": dict(num_blocks=300, max_num_batched_tokens=12),
    "preemption": dict(max_model_len=64, block_size=4, num_blocks=320, memory_policy="lru-static",
                       max_lora_rank=16, max_loras=3),
}


@pytest.mark.parametrize("engine", ENGINES, ids=list(ENGINES))
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_alora_in_mixed_batch_matches_peft(tiny_alora_model, oracle, invocation, engine, kernel, monkeypatch):
    monkeypatch.setenv("LORAPLEX_LORA_KERNEL", kernel)
    llm = make_llm(tiny_alora_model, **ENGINES[engine])
    named = cases(invocation)
    requests = llm.generate([p for p, _ in named.values()], GREEDY, [a for _, a in named.values()])
    if engine == "preemption":
        assert llm.core.stats().num_preemptions > 0
    starts = dict(zip(named, (r.adapter_from for r in requests), strict=True))
    assert starts == {"block-boundary": BLOCK, "mid-block": BLOCK + 5, "repeated": 2 * BLOCK + 2,
                      "absent": ADAPTER_NEVER, "at-the-end": 30 - len(invocation), "standard-lora": 0,
                      "base": 0}
    check(llm, requests, oracle)


def test_alora_differs_from_standard_lora_and_base(tiny_alora_model, oracle, invocation):
    """The same weights as a standard LoRA give other tokens, and an absent invocation is the base."""
    llm = make_llm(tiny_alora_model, num_blocks=300)
    prompt = with_invocations(prompts([40], seed=3)[0], invocation, 30)
    alora, lora, base = llm.generate([prompt] * 3, GREEDY, ["alora00-r8", "lora00-r8", None])
    assert alora.output_token_ids != lora.output_token_ids
    [absent, base_again] = llm.generate([prompts([40], seed=4)[0]] * 2, GREEDY, ["alora00-r8", None])
    assert absent.output_token_ids == base_again.output_token_ids


def test_checkers_reuse_the_base_conversation(tiny_alora_model, oracle, invocation):
    """A base request computes the conversation; aLoRA requests on it start from its cached blocks
    (those wholly before the invocation), keyed as the base model's, and still equal peft."""
    llm = make_llm(tiny_alora_model, num_blocks=300)
    conversation = prompts([3 * BLOCK + 5], seed=5)[0]
    [answer] = llm.generate([conversation], GREEDY, [None])
    chat = conversation + answer.output_token_ids
    checks = [chat + invocation + prompts([4], seed=s)[0] for s in (6, 7)]
    stats = llm.core.memory_stats()
    hits_before = stats.prefix_hit_tokens
    requests = llm.generate(checks, GREEDY, ["alora00-r8", "alora01-r16"])
    whole_blocks = len(chat) // BLOCK * BLOCK
    assert llm.core.memory_stats().prefix_hit_tokens - hits_before == 2 * whole_blocks
    check(llm, requests, oracle)
    # the checkers' own blocks (from the invocation on) were not cached as the base model's
    [again] = llm.generate([checks[0]], GREEDY, [None])
    assert llm.core.memory_stats().prefix_hit_tokens - hits_before == 3 * whole_blocks


def test_a_swapped_out_conversation_comes_back_for_its_checkers(tiny_alora_model, oracle, invocation):
    """On a unified pool with a host tier: other traffic pushes the conversation's base-keyed blocks
    to the host; the checker swaps them back in (and still equals peft)."""
    llm = make_llm(tiny_alora_model, num_blocks=100, num_host_blocks=300, max_num_seqs=4)
    conversation = prompts([4 * BLOCK + 3], seed=8)[0]
    [answer] = llm.generate([conversation], GREEDY, [None])
    llm.generate(prompts([110] * 16, seed=9), GREEDY, [None] * 16)  # fills the device pool
    assert llm.core.memory_stats().kv_swap_outs > 0
    chat = conversation + answer.output_token_ids
    hits_before = llm.core.memory_stats().prefix_hit_tokens
    [checker] = llm.generate([chat + invocation + [11, 12, 13]], GREEDY, ["alora01-r16"])
    stats = llm.core.memory_stats()
    assert stats.kv_swap_ins > 0 and stats.prefix_hit_tokens - hits_before == len(chat) // BLOCK * BLOCK
    assert checker.num_cached_tokens == len(chat) // BLOCK * BLOCK
    check(llm, [checker], oracle)


def test_a_repeated_checker_reuses_its_own_blocks_and_no_other_adapter_does(tiny_alora_model, oracle, invocation):
    """The blocks from the invocation on are cached under the adapter's identity (name + digest): the
    same aLoRA request again starts from all of them; another aLoRA adapter, or the same name
    reloaded with other weights (a new digest), only from the base model's blocks before it."""
    llm = make_llm(tiny_alora_model, num_blocks=300)
    chat = prompts([3 * BLOCK + 5], seed=10)[0]
    check_prompt = chat + invocation + prompts([2 * BLOCK], seed=11)[0]
    base_part = len(chat) // BLOCK * BLOCK
    whole = (len(check_prompt) - 1) // BLOCK * BLOCK  # one token is always computed
    [first] = llm.generate([check_prompt], GREEDY, ["alora00-r8"])
    [again] = llm.generate([check_prompt], GREEDY, ["alora00-r8"])
    [other] = llm.generate([check_prompt], GREEDY, ["alora01-r16"])
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, whole, base_part)
    check(llm, [first, again, other], oracle)
    llm.remove_adapter("alora00-r8")
    llm.add_adapter("alora00-r8", tiny_alora_model.adapters["alora01-r16"])  # new weights, new digest
    [reloaded] = llm.generate([check_prompt], GREEDY, ["alora00-r8"])
    assert reloaded.num_cached_tokens == base_part
    expected = oracle.logits(check_prompt, reloaded.output_token_ids, "alora01-r16")[len(check_prompt) - 1:-1]
    ours = torch.stack(llm.executor.captured_logits[reloaded.request_id])
    assert (ours - expected).abs().max().item() <= 1e-4


def test_a_checker_block_is_reused_only_from_the_same_invocation(tiny_alora_model, oracle, invocation):
    """Two prompts equal up to the end of a block, whose last invocations start at different places
    in it, computed that block differently: the second does not take the first's."""
    assert len(invocation) >= 2
    llm = make_llm(tiny_alora_model, num_blocks=300)
    early, late = 2 * BLOCK + 2, 3 * BLOCK - 1  # both in block 2
    text = with_invocations(prompts([3 * BLOCK], seed=12)[0], invocation, early)[:late]
    first = text + [invocation[0], invocation[1] + 1] + prompts([BLOCK], seed=13)[0]
    second = text + invocation + prompts([BLOCK], seed=14)[0]
    assert first[:3 * BLOCK] == second[:3 * BLOCK]
    [a] = llm.generate([first], GREEDY, ["alora00-r8"])
    [b] = llm.generate([second], GREEDY, ["alora00-r8"])
    assert (a.adapter_from, b.adapter_from) == (early, late)
    assert b.num_cached_tokens == 2 * BLOCK  # the base model's blocks before block 2, not block 2
    check(llm, [a, b], oracle)
