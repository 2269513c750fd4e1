"""Per-request sampling parameters, validated once when a request is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.spec.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


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
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k must be -1, 0 or positive", "top_k")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                   f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
