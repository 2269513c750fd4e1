"""Activated LoRA (aLoRA): where an adapter's delta starts in a prompt, as PEFT finds it.

An aLoRA adapter (PEFT `LoraConfig(alora_invocation_tokens=[...])`) changes the computation only
from the *last* occurrence of its invocation token sequence in the prompt on, the invocation's own
tokens included, and on every generated token. A prompt without the invocation runs the base model
throughout, generated tokens included. Because attention is causal, the KV of every token before
the invocation is the base model's: the base model and every aLoRA adapter of that base share it.
"""

from __future__ import annotations

from collections.abc import Sequence

ADAPTER_NEVER = 1 << 62
"""The first position of an adapter's delta when the prompt lacks the invocation: beyond any position."""


def invocation_start(prompt: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Position of the last occurrence of `invocation` in `prompt`, or None when it does not occur."""
    n = len(invocation)
    if n == 0:
        raise ValueError("an invocation needs at least one token")
    first = invocation[0]
    pattern = list(invocation)
    for start in range(len(prompt) - n, -1, -1):
        if prompt[start] == first and list(prompt[start:start + n]) == pattern:
            return start
    return None


def adapter_start(prompt: Sequence[int], invocation: Sequence[int]) -> int:
    """First position whose computation uses the adapter: 0 for a standard LoRA (no invocation),
    the invocation's start for an aLoRA, `ADAPTER_NEVER` when the prompt lacks the invocation."""
    if not invocation:
        return 0
    start = invocation_start(prompt, invocation)
    return ADAPTER_NEVER if start is None else start



def backend_refusal(backend: str) -> str | None:
    """Why a pool on `backend` cannot serve an activated LoRA; None when it can. The vllm backend
    applies every adapter to the whole prompt (vLLM has no aLoRA): it would compute something other
    than what the adapter was trained for."""
    if backend != "vllm":
        return None
    return ("the adapter is an activated LoRA (alora_invocation_tokens) and the pool runs engine.backend "
            "vllm, which cannot serve one: deploy it to a pool on the loraplex engine")
