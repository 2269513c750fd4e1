"""Next-token sampling per request: greedy, temperature, top-k, top-p, seed, logprobs.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p). A seeded
request draws its noise from its own generator, seeded by (seed, number of tokens generated so
far), so it yields the same tokens alone, inside any batch, and after a preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.request import SampledToken
from loraplex.engine.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 steps: Sequence[int]) -> list[SampledToken]:
        """logits [n, vocab] float32, one row per request; steps[i] = tokens request i has generated."""
        tokens = self._choose(logits, params, steps).tolist()
        if all(p.logprobs is None for p in params):
            return [SampledToken(t) for t in tokens]
        logprobs = torch.log_softmax(logits, dim=-1)
        return [_with_logprobs(t, logprobs[i], p.logprobs) if p.logprobs is not None else SampledToken(t)
                for i, (t, p) in enumerate(zip(tokens, params, strict=True))]

    def _choose(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                steps: Sequence[int]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = [params[i] for i in random_rows]
            probs = torch.softmax(restrict(logits[rows], chosen), dim=-1)
            noise = self._noise(probs.shape, chosen, [steps[i] for i in random_rows])
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def _noise(self, shape: torch.Size, params: Sequence[SamplingParams], steps: Sequence[int]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        for row, (p, step) in enumerate(zip(params, steps, strict=True)):
            if p.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed((p.seed * _SEED_MIX + step) % 2**63)
                noise[row].exponential_(generator=generator)
        return noise


def restrict(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with everything outside each row's top-k / top-p set to -inf."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    scaled = logits / temps.unsqueeze(1)
    vocab = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k, device=logits.device).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
    drop |= mass_before >= torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always stays
    return scaled.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def _with_logprobs(token: int, logprobs: torch.Tensor, num_top: int) -> SampledToken:
    top = None
    if num_top > 0:
        values, ids = logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[token]), top)
