"""Per-request sampling parameters, validated once when a request is built."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.spec.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI)

LogitBias = tuple[tuple[int, float], ...]


class TokenHistory(Protocol):
    """What the penalties, JSON mode and prompt logprobs read: the request's prompt, the tokens
    generated so far and its EOS token ids (a `Request`)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: also the top k
    min_tokens: int = 0
    presence_penalty: float = 0.0  # minus this for every token id generated at least once
    frequency_penalty: float = 0.0  # minus this times the times a token id was generated
    repetition_penalty: float = 1.0  # HF / vLLM: prompt and generated token ids, > 0 divides, < 0 multiplies
    logit_bias: LogitBias = ()  # (token id, bias) pairs added to the logits; a dict is accepted too
    json_object: bool = False  # the output must be one JSON object (response_format json_object)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k
    extra: dict = field(default_factory=dict, compare=False)
    # The tokens the penalties, JSON mode and prompt logprobs read; `Request` binds itself here
    # when one of them is set (`reads_history`).
    history: TokenHistory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k must be -1, 0 or positive", "top_k")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_TOP_LOGPROBS,
                   f"{name} must be between 0 and {MAX_TOP_LOGPROBS}", name)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY,
                   f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}", name)
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty must be a positive number",
               "repetition_penalty")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A penalty reads the request's tokens (see `history`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_history(self) -> bool:
        """The sampler or the executor reads the request's tokens (see `history`)."""
        return self.penalized or self.json_object or self.prompt_logprobs is not None

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a logit bias changes the logits before the token is chosen."""
        return self.penalized or bool(self.logit_bias)


def _logit_bias(bias: LogitBias | Mapping[int, float]) -> LogitBias:
    """The bias as sorted (token id, bias) pairs, each id non-negative and each bias in range."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    for pair in pairs:
        _check(isinstance(pair, tuple) and len(pair) == 2, "logit_bias must map token ids to biases",
               "logit_bias")
        token, value = pair
        _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
               f"logit_bias keys must be token ids (non-negative integers), got {token!r}", "logit_bias")
        _check(isinstance(value, (int, float)) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
               f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got "
               f"{value!r} for token {token}", "logit_bias")
    _check(len({token for token, _ in pairs}) == len(pairs), "logit_bias names a token id twice", "logit_bias")
    return tuple(sorted((token, float(value)) for token, value in pairs))


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
