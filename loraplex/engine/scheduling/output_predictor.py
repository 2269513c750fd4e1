"""An online output-length predictor: learns from finished requests, per adapter and prompt length.

No trained model is needed (Chameleon used a BERT proxy; none can be downloaded here). Every
finished request adds its generated length to four running means, from coarse to fine:

    all requests -> prompt-length bucket -> adapter -> adapter x prompt-length bucket

A prediction walks that chain, each level pulling the one before towards its own mean as it gains
observations: `estimate = (sum + k * parent) / (count + k)` with `k = prior_weight`. A new adapter
therefore starts from what similar prompts produced, and a busy one soon speaks for itself. Means
decay (`1 - 1/window` per observation of that level), so a changed workload is followed. Prompt
buckets are powers of two (1, 2-3, 4-7, ...). A prediction is clamped to [min_tokens, max_out].

Requests stopped by max_tokens teach their cut length: a client that asks for 16 tokens and gets
16 is predicted to use them again. Aborted requests teach nothing.

Per arrival: four dict lookups. The running error is kept on predictions actually made (the
scheduler hands back what it predicted when the request arrived).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.scheduling.stats import PredictorStats
from loraplex.spec.adapter import AdapterId

_ALL = ("all",)


@dataclass(frozen=True)
class PredictorOptions:
    prior_tokens: float = 128.0  # the guess before anything finished
    prior_weight: float = 2.0  # observations a level needs to weigh as much as its parent
    predictor_window: int = 256  # observations after which an old one weighs 1/e
    error_window: int = 256  # the same for the error statistics

    def __post_init__(self) -> None:
        if self.prior_tokens < 1 or self.prior_weight <= 0 or self.predictor_window < 1 or self.error_window < 1:
            raise ValueError("predictor options must be positive (prior_tokens at least 1)")


class OutputLengthPredictor:
    def __init__(self, options: PredictorOptions | None = None) -> None:
        self.options = options or PredictorOptions()
        self._decay = 1.0 - 1.0 / self.options.predictor_window
        self._cells: dict[tuple, list[float]] = {}  # level key -> [decayed count, decayed sum]
        self._observations = 0
        self._err = _Ewma(1.0 / self.options.error_window)
        self._rel = _Ewma(1.0 / self.options.error_window)
        self._bias = _Ewma(1.0 / self.options.error_window)

    @staticmethod
    def bucket(num_prompt_tokens: int) -> int:
        return max(1, num_prompt_tokens).bit_length()

    def _levels(self, adapter: AdapterId | None, num_prompt_tokens: int) -> tuple[tuple, ...]:
        b = self.bucket(num_prompt_tokens)
        return _ALL, ("bucket", b), ("adapter", adapter), ("adapter", adapter, b)

    def estimate(self, adapter: AdapterId | None, num_prompt_tokens: int) -> float:
        """The unclamped estimate in tokens."""
        k = self.options.prior_weight
        value = self.options.prior_tokens
        cells = self._cells
        for key in self._levels(adapter, num_prompt_tokens):
            cell = cells.get(key)
            if cell is not None:
                value = (cell[1] + k * value) / (cell[0] + k)
        return value

    def predict(self, adapter: AdapterId | None, num_prompt_tokens: int, max_out: int, min_out: int = 1) -> int:
        """Predicted output tokens, in [max(1, min_out), max_out]."""
        value = max(1, min_out, round(self.estimate(adapter, num_prompt_tokens)))
        return max(1, min(max_out, value))

    def observe(self, adapter: AdapterId | None, num_prompt_tokens: int, actual: int,
                predicted: int | None = None) -> None:
        """A request finished after generating `actual` tokens; `predicted` is what was said at arrival."""
        decay, cells = self._decay, self._cells
        for key in self._levels(adapter, num_prompt_tokens):
            cell = cells.get(key)
            if cell is None:
                cells[key] = [1.0, float(actual)]
            else:
                cell[0] = cell[0] * decay + 1.0
                cell[1] = cell[1] * decay + actual
        self._observations += 1
        if predicted is not None:
            self._err.add(abs(predicted - actual))
            self._rel.add(abs(predicted - actual) / max(1, actual))
            self._bias.add(predicted - actual)

    def stats(self) -> PredictorStats:
        return PredictorStats(observations=self._observations, mean_abs_error=self._err.value,
                              mean_rel_error=self._rel.value, bias=self._bias.value)


class _Ewma:
    """Mean of the values so far while there are fewer than 1/alpha, then an exponential average."""

    __slots__ = ("alpha", "n", "value")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.n = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += (x - self.value) * max(self.alpha, 1.0 / self.n)
