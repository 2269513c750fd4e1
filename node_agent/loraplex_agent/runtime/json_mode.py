"""JSON mode in the sampler (`response_format: {"type": "json_object"}`): every token keeps the
output a prefix of one JSON object (`loraplex.engine.output.json_grammar`), and once the object is closed
the output ends (EOS is forced).

A constrained row walks the sampler's own ranking of the tokens, best first, and takes the first
token whose text keeps the output valid. A greedy row ranks by its adjusted logits. A random row
ranks by its exponential-race keys p / E (the sampler's draw: `argmax(p / E)`, `E ~ Exp(1)`, from
the request's seeded generator when it has a seed); the argmax of p_i / E_i over any subset S of
the tokens is distributed as p restricted to S and renormalized, so the best valid key is an exact
draw from the masked distribution: rejection sampling whose redraws cost nothing. Logit bias,
penalties, temperature, top-k and top-p apply first (the race runs within the top-k / top-p set);
when no token of that set fits, the walk goes on over the whole temperature-scaled vocabulary, so
a narrow top-p never stops a constrained row. Only the first `FIRST_TRIES` tokens of a ranking
are tried one by one; past them, the candidates narrow to tokens whose text starts with a
character that may come next. When no token at all fits, the row gets `NO_TOKEN` and the request
ends with finish_reason "length".
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.engine.output.json_grammar import JsonPrefix
from loraplex.engine.output.sampling import SamplingParams, TokenHistory
from loraplex.engine.request import NO_TOKEN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FIRST_TRIES = 32  # tokens of a ranking tried one by one before narrowing by first character
Ranking = Callable[[], torch.Tensor]  # a row's keys over the vocabulary, computed when needed


class TokenTexts:
    """Each token id's text as it appears in the output, and the token ids by first character.

    A token is decoded after a plain ASCII token, as the detokenizer decodes the output with
    context, so a SentencePiece token keeps its leading space. A token that holds part of a UTF-8
    character decodes to U+FFFD, which the grammar allows only inside strings: exactly where such
    bytes can stand, and the character they form there is as good as U+FFFD. Special tokens (EOS
    included) and ids past the tokenizer decode to "" and are never taken for text."""

    def __init__(self, texts: list[str], device: torch.device) -> None:
        self.texts = texts
        self.device = device
        self._by_first_char: defaultdict[str, list[int]] = defaultdict(list)
        for token, text in enumerate(texts):
            if text:
                self._by_first_char[text[0]].append(token)
        self._candidates: dict[frozenset[str], torch.Tensor] = {}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, device: torch.device) -> TokenTexts:
        """The texts of the model's `vocab_size` token ids (one batched decode)."""
        anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
        prefix = _decode(tokenizer, [anchor])[0]
        known = min(vocab_size, len(tokenizer))
        decoded = _decode(tokenizer, [anchor + [token] for token in range(known)])
        if not all(text.startswith(prefix) for text in decoded):  # a decoder that rewrites the anchor
            prefix, decoded = "", _decode(tokenizer, [[token] for token in range(known)])
        return cls([text[len(prefix):] for text in decoded] + [""] * (vocab_size - known), device)

    def continues(self, state: JsonPrefix, token: int, ends: tuple[int, ...]) -> bool:
        """Whether `token`'s text keeps the output a JSON-object prefix (an end token never does:
        it would end the output before the object is closed)."""
        text = self.texts[token]
        return bool(text) and token not in ends and state.feed(text) is not None

    def candidates(self, state: JsonPrefix) -> torch.Tensor | None:
        """Ids of the tokens whose first character may come next; None when almost any may."""
        allowed = state.next_chars()
        if allowed is None:
            return None
        ids = self._candidates.get(allowed)
        if ids is None:
            found = sorted(token for ch in allowed for token in self._by_first_char.get(ch, ()))
            ids = self._candidates[allowed] = torch.tensor(found, dtype=torch.long, device=self.device)
        return ids


def _decode(tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]]) -> list[str]:
    return tokenizer.batch_decode(sequences, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@dataclass
class _Progress:
    """A request's grammar state after its first `consumed` output tokens."""

    consumed: int
    state: JsonPrefix | None  # None: the output left the grammar (never, for tokens chosen here)
    owner: weakref.ref


class JsonMode:
    """The constraint for the requests with `SamplingParams.json_object`; states per request,
    advanced by the tokens each generated since its last step (so a preemption changes nothing),
    and dropped when the request is garbage."""

    def __init__(self) -> None:
        self._texts: TokenTexts | None = None
        self._progress: dict[int, _Progress] = {}

    def use_vocabulary(self, texts: TokenTexts) -> None:
        """The token texts (the tokenizer's; `LLM` gives them when it starts, so that the first
        constrained request neither waits for them nor decodes beside the server's thread)."""
        self._texts = texts
        self._progress.clear()

    @property
    def texts(self) -> TokenTexts:
        if self._texts is None:
            raise ValueError("JSON mode needs the token texts: call use_vocabulary first (LLM does)")
        return self._texts

    def choose(self, params: SamplingParams, rankings: list[Ranking]) -> int:
        """The first token of the first ranking that keeps the output valid; EOS (or the first stop
        token id) once the object is complete; `NO_TOKEN` when nothing fits."""
        history = params.history
        if history is None:
            raise ValueError("JSON mode needs the request's tokens: build the Request with these parameters")
        state = self.state(history)
        ends = (*history.eos_token_ids, *params.stop_token_ids)
        if state is None or state.complete:
            return ends[0] if state is not None and ends else NO_TOKEN
        for ranking in rankings:
            token = self._best(state, ranking(), ends)
            if token is not None:
                return token
        return NO_TOKEN

    def state(self, history: TokenHistory) -> JsonPrefix | None:
        """The grammar state after `history`'s output so far."""
        progress = self._progress_of(history)
        output, texts = history.output_token_ids, self.texts.texts
        if len(output) < progress.consumed:  # never happens to a Request; rebuilt rather than trusted
            progress.consumed, progress.state = 0, JsonPrefix.start()
        while progress.consumed < len(output) and progress.state is not None and not progress.state.complete:
            progress.state = progress.state.feed(texts[output[progress.consumed]])
            progress.consumed += 1
        return progress.state

    def _progress_of(self, history: TokenHistory) -> _Progress:
        key = id(history)
        progress = self._progress.get(key)
        if progress is None or progress.owner() is not history:
            owner = weakref.ref(history, lambda _, key=key, entries=self._progress: entries.pop(key, None))
            progress = self._progress[key] = _Progress(0, JsonPrefix.start(), owner)
        return progress

    def __len__(self) -> int:
        return len(self._progress)

    def _best(self, state: JsonPrefix, keys: torch.Tensor, ends: tuple[int, ...]) -> int | None:
        texts = self.texts
        values, ids = keys.topk(min(FIRST_TRIES, keys.numel()))
        token = _first_valid(texts, state, values.tolist(), ids.tolist(), ends)
        if token is not None or values[-1].item() == -math.inf:
            return token  # found, or every token past these is ruled out already
        candidates = texts.candidates(state)
        if candidates is not None:
            keys = keys[candidates]
        order = keys.argsort(descending=True)
        ids = order if candidates is None else candidates[order]
        return _first_valid(texts, state, keys[order].tolist(), ids.tolist(), ends)


def _first_valid(texts: TokenTexts, state: JsonPrefix, values: list[float], ids: list[int],
                 ends: tuple[int, ...]) -> int | None:
    for value, token in zip(values, ids, strict=True):
        if value == -math.inf:
            return None  # ruled out (outside top-k / top-p), and so is every token after it
        if texts.continues(state, token, ends):
            return token
    return None


def greedy_ranking(logits: torch.Tensor) -> list[Ranking]:
    """A greedy row ranks by its adjusted logits."""
    return [lambda: logits]


def race_rankings(logits: torch.Tensor, race: torch.Tensor, noise: torch.Tensor, temperature: float) -> list[Ranking]:
    """A random row ranks by its race keys within the top-k / top-p set (log(0) = -inf outside),
    then by the keys the whole temperature-scaled vocabulary gives with the same noise."""
    return [lambda: race.log(), lambda: torch.log_softmax(logits / temperature, dim=-1) - noise.log()]
