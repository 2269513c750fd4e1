"""The mixed batch the engine oracle tests run: adapters of ranks 8, 16 and 64 beside a base-model
request, greedy, and random prompts of given lengths."""

from __future__ import annotations

import random

from loraplex.engine.output.sampling import SamplingParams

MIX = ["lora00-r8", "lora01-r16", "lora03-r64", None, "lora04-r8", "lora03-r64"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(n)] for n in lengths]
