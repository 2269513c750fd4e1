"""Token ids to text, a few tokens at a time, and stop strings cut out of that text.

Decoding each new token on its own gets spaces and multi-byte characters wrong (a token can be
half of a UTF-8 character, or its leading space depends on the token before). So the detokenizer
decodes a short window ending at the new tokens and emits only the text the window added, and
holds text back while it ends in an incomplete character.
"""

from __future__ import annotations

from typing import Protocol

PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded with the first output tokens, for their spacing
INCOMPLETE_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.token_ids)  # tokens before this have been emitted as text

    def add(self, new_token_ids: list[int]) -> str:
        """The text that `new_token_ids` complete; may be empty while a character is incomplete."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(INCOMPLETE_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """The text still held back (at the end of the output, even if it is incomplete)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)


class StopStringMatcher:
    """Accumulates output text, finds the first stop string and releases only safe text.

    While streaming, the last `len(longest stop) - 1` characters are held back, because they
    may be the start of a stop string that the next token completes.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def add(self, delta: str, final: bool) -> str:
        """Append `delta`; return the text that may be released now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        cut = self._first_stop(search_from)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.holdback)
        released = self.text[self.sent:end]
        self.sent = end
        return released

    def _first_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
