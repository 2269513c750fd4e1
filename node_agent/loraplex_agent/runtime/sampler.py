"""Next-token sampling per request: logit bias, penalties, greedy, temperature, top-k, top-p, seed,
logprobs.

The logits a row is chosen from are adjusted first, per request and vectorised over the batch, in
vLLM's order: `logit_bias` is added, then `repetition_penalty` (HF's RepetitionPenaltyLogitsProcessor
over prompt and generated token ids: a positive logit is divided by it, a negative one multiplied),
then `frequency_penalty * count + presence_penalty * (count > 0)` is subtracted, counts over the
generated tokens (OpenAI's definition). Temperature, top-k and top-p follow. Logprobs stay the
`log_softmax` of the raw logits, before any of this.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p). A seeded
request draws its noise from its own generator, seeded by (seed, number of tokens generated so
far), so it yields the same tokens alone, inside any batch, and after a preemption.

Rows in JSON mode (`SamplingParams.json_object`) then take the best-ranked token that keeps their
output a JSON-object prefix (`loraplex_agent.runtime.json_mode`); the other rows are chosen exactly as
without them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.engine.output.sampling import SamplingParams, TokenHistory
from loraplex.engine.request import NO_TOKEN, SampledToken
from loraplex_agent.runtime.json_mode import JsonMode, greedy_ranking, race_rankings

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.tokens = TokenTensors(device)
        self.json = JsonMode()  # the LLM gives it the token texts (`use_vocabulary`)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 steps: Sequence[int]) -> list[SampledToken]:
        """logits [n, vocab] float32, one row per request; steps[i] = tokens request i has generated."""
        tokens = self._choose(adjust(logits, params, self.tokens), params, steps)
        if all(p.logprobs is None for p in params):
            return [SampledToken(t) for t in tokens]
        logprobs = torch.log_softmax(logits, dim=-1)
        return [_with_logprobs(t, logprobs[i], p.logprobs) if p.logprobs is not None and t != NO_TOKEN
                else SampledToken(t) for i, (t, p) in enumerate(zip(tokens, params, strict=True))]

    def _choose(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        races: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # JSON-mode row -> (race keys, noise)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = [params[i] for i in random_rows]
            probs = torch.softmax(restrict(logits[rows], chosen), dim=-1)
            noise = self._noise(probs.shape, chosen, [steps[i] for i in random_rows])
            race = probs / noise
            tokens[rows] = race.argmax(dim=-1)
            races = {row: (race[j], noise[j]) for j, row in enumerate(random_rows) if params[row].json_object}
        chosen_ids = tokens.tolist()
        self._constrain(chosen_ids, logits, params, races)
        return chosen_ids

    def _constrain(self, tokens: list[int], logits: torch.Tensor, params: Sequence[SamplingParams],
                   races: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """JSON-mode rows take the best-ranked token that keeps their output valid: by the
        adjusted logits when greedy, by the race keys of the draw above when random."""
        for row, p in enumerate(params):
            if p.json_object:
                race = races.get(row)
                rankings = greedy_ranking(logits[row]) if race is None else race_rankings(logits[row], *race,
                                                                                           p.temperature)
                tokens[row] = self.json.choose(p, rankings)

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


# ---- logit bias and penalties ----------------------------------------------------------------


def adjust(logits: torch.Tensor, params: Sequence[SamplingParams], tokens: TokenTensors) -> torch.Tensor:
    """The logits after each row's logit bias and penalties; `logits` itself when no row has any."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    adjusted = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    chosen = [params[i] for i in rows]
    part = add_logit_bias(logits[index], chosen)
    part = apply_repetition_penalty(part, chosen, tokens)
    adjusted[index] = apply_frequency_presence(part, chosen, tokens)
    return adjusted


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return logits
    rows, ids, biases = zip(*entries, strict=True)
    index = (_ints(rows, logits.device), _ints(ids, logits.device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                            accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, params: Sequence[SamplingParams],
                             tokens: TokenTensors) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor per row, over the prompt and the generated tokens."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    histories = [_history(params[i]) for i in rows]
    ids = [torch.cat([tokens.prompt(h), tokens.output(h)]) for h in histories]
    seen = _occurrences(ids, logits.shape[-1], logits.device) > 0
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], dtype=logits.dtype,
                           device=logits.device).unsqueeze(1)
    index = _ints(rows, logits.device)
    part = logits[index]
    penalized = torch.where(part > 0, part / penalty, part * penalty)
    out = logits.clone()
    out[index] = torch.where(seen, penalized, part)
    return out


def apply_frequency_presence(logits: torch.Tensor, params: Sequence[SamplingParams],
                             tokens: TokenTensors) -> torch.Tensor:
    """OpenAI's penalties per row: counts of each token id among the generated tokens."""
    rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return logits
    counts = _occurrences([tokens.output(_history(params[i])) for i in rows], logits.shape[-1],
                          logits.device).to(logits.dtype)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype,
                             device=logits.device).unsqueeze(1)
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype,
                            device=logits.device).unsqueeze(1)
    index = _ints(rows, logits.device)
    out = logits.clone()
    out[index] = logits[index] - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return out


def _occurrences(ids: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab] int32: how often each token id occurs in each row's ids, in one scatter."""
    lengths = torch.tensor([len(t) for t in ids], device=device)
    rows = torch.repeat_interleave(torch.arange(len(ids), device=device), lengths)
    flat = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long, device=device)
    counts = torch.zeros(len(ids), vocab, dtype=torch.int32, device=device)
    return counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.int32), accumulate=True)


def _history(params: SamplingParams) -> TokenHistory:
    if params.history is None:
        raise ValueError("a penalty needs the request's tokens: build the Request with these parameters")
    return params.history


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass
class _Copies:
    prompt: torch.Tensor | None  # the prompt's distinct token ids
    output: torch.Tensor  # the generated token ids so far
    owner: weakref.ref | None


class TokenTensors:
    """Device copies of each running request's token ids for the penalties: the prompt's copied
    once, the output's extended by the tokens generated since the last step (not rebuilt from
    Python lists every step). A copy is dropped when its request is garbage."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copies: dict[int, _Copies] = {}

    def prompt(self, history: TokenHistory) -> torch.Tensor:
        copies = self._copies_of(history)
        if copies.prompt is None:
            copies.prompt = torch.unique(torch.tensor(history.prompt_token_ids, dtype=torch.long)).to(self.device)
        return copies.prompt

    def output(self, history: TokenHistory) -> torch.Tensor:
        copies = self._copies_of(history)
        done, ids = len(copies.output), history.output_token_ids
        if len(ids) < done:  # never happens to a Request; rebuilt rather than trusted
            copies.output, done = copies.output[:0], 0
        if len(ids) > done:
            copies.output = torch.cat([copies.output, _ints(ids[done:], self.device)])
        return copies.output

    def __len__(self) -> int:
        return len(self._copies)

    def _copies_of(self, history: TokenHistory) -> _Copies:
        key = id(history)
        copies = self._copies.get(key)
        if copies is not None and copies.owner is not None and copies.owner() is history:
            return copies
        copies = _Copies(None, torch.empty(0, dtype=torch.long, device=self.device), None)
        try:  # dropped with its request; a history that cannot be weakly referenced is not kept
            copies.owner = weakref.ref(history, lambda _, key=key, entries=self._copies: entries.pop(key, None))
        except TypeError:
            return copies
        self._copies[key] = copies
        return copies


def _with_logprobs(token: int, logprobs: torch.Tensor, num_top: int) -> SampledToken:
    top = None
    if num_top > 0:
        values, ids = logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[token]), top)
