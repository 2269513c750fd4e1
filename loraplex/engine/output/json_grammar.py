"""JSON mode's grammar: an incremental recognizer of prefixes of one JSON object (RFC 8259).

`JsonPrefix.start().feed(text)` is the state after `text`, or None when no continuation of `text`
is a JSON object. The output must be exactly one object: its first character is `{` (no whitespace
before it, so a model cannot drift into an endless run of blanks before starting) and nothing may
follow its closing `}` (the sampler then forces EOS). Inside the object, whitespace is allowed
wherever JSON allows it. Strings take any character but `"`, `\\` and the control characters
U+0000..U+001F, plus the escapes `\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`; numbers, `true`, `false` and
`null` follow the RFC (no NaN, no leading zeros, no `+`).

A state is an immutable stack (a tuple): trying a candidate token never disturbs a request's
state, and equal stacks are equal states. Each frame below the top says what its container
expects once the value above it ends; the top is the lexer's current position. Pure Python and
torch-free, like every policy of the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

# Frames of the stack. The root accepts `{` only; DONE accepts nothing.
ROOT, DONE = 0, 1
OBJ_OPEN, OBJ_KEY, OBJ_COLON, OBJ_VALUE, OBJ_NEXT = 2, 3, 4, 5, 6  # after `{`, `,`, a key, `:`, a member
ARR_OPEN, ARR_VALUE, ARR_NEXT = 7, 8, 9  # after `[`, `,`, an element
STR, STR_ESC, STR_U1, STR_U2, STR_U3, STR_U4 = 10, 11, 12, 13, 14, 15  # STR_Uk: k hex digits to go
NUM_MINUS, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_EXP, NUM_EXP_SIGN, NUM_EXP_DIGITS = range(16, 24)
# A literal (true, false, null) under way is the str of its remaining characters.

Frame = int | str
Stack = tuple[Frame, ...]

WHITESPACE = frozenset(" \t\n\r")
DIGITS = "0123456789"
HEX_DIGITS = frozenset(DIGITS + "abcdefABCDEF")
SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
ASCII = tuple(chr(c) for c in range(128))  # outside strings, JSON is ASCII
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')  # plain string characters, consumed in one go

# Numbers: moves per frame, and the frames where a number may end (the next character then
# belongs to the container).
_NUMBER_MOVES: dict[int, dict[str, int]] = {
    NUM_MINUS: {"0": NUM_ZERO, **dict.fromkeys("123456789", NUM_INT)},
    NUM_ZERO: {".": NUM_DOT, "e": NUM_EXP, "E": NUM_EXP},
    NUM_INT: {**dict.fromkeys(DIGITS, NUM_INT), ".": NUM_DOT, "e": NUM_EXP, "E": NUM_EXP},
    NUM_DOT: dict.fromkeys(DIGITS, NUM_FRAC),
    NUM_FRAC: {**dict.fromkeys(DIGITS, NUM_FRAC), "e": NUM_EXP, "E": NUM_EXP},
    NUM_EXP: {"+": NUM_EXP_SIGN, "-": NUM_EXP_SIGN, **dict.fromkeys(DIGITS, NUM_EXP_DIGITS)},
    NUM_EXP_SIGN: dict.fromkeys(DIGITS, NUM_EXP_DIGITS),
    NUM_EXP_DIGITS: dict.fromkeys(DIGITS, NUM_EXP_DIGITS),
}
_NUMBER_ENDS = frozenset({NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP_DIGITS})


class JsonPrefix:
    """The recognizer's state after some text; immutable."""

    __slots__ = ("stack",)

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    @classmethod
    def start(cls) -> JsonPrefix:
        return _START

    @property
    def complete(self) -> bool:
        """The top-level object is closed: only the end of the output may follow."""
        return self.stack == (DONE,)

    def feed(self, text: str) -> JsonPrefix | None:
        """The state after `text` too, or None when the output could then never be a JSON object."""
        stack = self.stack
        i, end = 0, len(text)
        while i < end:
            if stack[-1] == STR:
                run = _STRING_RUN.match(text, i)
                if run is not None:
                    i = run.end()
                    continue
            stack = _step(stack, text[i])
            if stack is None:
                return None
            i += 1
        return self if stack is self.stack else JsonPrefix(stack)

    def next_chars(self) -> frozenset[str] | None:
        """The characters that may come next, or None inside a string (where almost any may)."""
        return _next_chars(self.stack)

    def closing(self) -> str:
        """A shortest text that completes the object (tests use it to check prefixes)."""
        return "".join(_closing(frame) for frame in reversed(self.stack))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonPrefix) and other.stack == self.stack

    def __hash__(self) -> int:
        return hash(self.stack)

    def __repr__(self) -> str:
        return f"JsonPrefix({self.stack!r})"


_START = JsonPrefix((ROOT,))


def is_json_object_prefix(text: str) -> bool:
    """`text` can still be completed to one JSON object (by the rules above)."""
    return _START.feed(text) is not None


def is_json_object(text: str) -> bool:
    """`text` is exactly one JSON object (by the rules above)."""
    state = _START.feed(text)
    return state is not None and state.complete


# ---- transitions ------------------------------------------------------------------------------


def _step(stack: Stack, ch: str) -> Stack | None:
    top = stack[-1]
    if type(top) is str:  # inside true / false / null
        if ch != top[0]:
            return None
        return stack[:-1] + (top[1:],) if len(top) > 1 else stack[:-1]
    if top in _NUMBER_MOVES:
        return _number(stack, top, ch)
    return _HANDLERS[top](stack, ch)


def _root(stack: Stack, ch: str) -> Stack | None:
    return (DONE, OBJ_OPEN) if ch == "{" else None


def _done(stack: Stack, ch: str) -> Stack | None:
    return None


def _object_open(stack: Stack, ch: str) -> Stack | None:
    if ch == "}":
        return stack[:-1]
    return _object_key(stack, ch)


def _object_key(stack: Stack, ch: str) -> Stack | None:
    if ch in WHITESPACE:
        return stack
    return stack[:-1] + (OBJ_COLON, STR) if ch == '"' else None


def _object_colon(stack: Stack, ch: str) -> Stack | None:
    if ch in WHITESPACE:
        return stack
    return stack[:-1] + (OBJ_VALUE,) if ch == ":" else None


def _object_value(stack: Stack, ch: str) -> Stack | None:
    return _member_value(stack, ch, OBJ_NEXT)


def _object_next(stack: Stack, ch: str) -> Stack | None:
    return _after_member(stack, ch, OBJ_KEY, "}")


def _array_open(stack: Stack, ch: str) -> Stack | None:
    if ch == "]":
        return stack[:-1]
    return _array_value(stack, ch)


def _array_value(stack: Stack, ch: str) -> Stack | None:
    return _member_value(stack, ch, ARR_NEXT)


def _array_next(stack: Stack, ch: str) -> Stack | None:
    return _after_member(stack, ch, ARR_VALUE, "]")


def _member_value(stack: Stack, ch: str, then: Frame) -> Stack | None:
    """A value of an object or array, after which the container expects `then`."""
    if ch in WHITESPACE:
        return stack
    return _start_value(stack[:-1] + (then,), ch)


def _after_member(stack: Stack, ch: str, again: Frame, close: str) -> Stack | None:
    """After a member: ',' expects `again` (another member), `close` ends the container."""
    if ch in WHITESPACE:
        return stack
    if ch == ",":
        return stack[:-1] + (again,)
    return stack[:-1] if ch == close else None


def _start_value(stack: Stack, ch: str) -> Stack | None:
    """`stack`'s top already says what follows the value; push the value's first frame."""
    frame = _VALUE_STARTS.get(ch)
    if frame is None:
        literal = LITERALS.get(ch)
        return None if literal is None else stack + (literal,)
    return stack + (frame,)


_VALUE_STARTS: dict[str, int] = {'"': STR, "{": OBJ_OPEN, "[": ARR_OPEN, "-": NUM_MINUS, "0": NUM_ZERO,
                                 **dict.fromkeys("123456789", NUM_INT)}


def _string(stack: Stack, ch: str) -> Stack | None:
    if ch == '"':
        return stack[:-1]
    if ch == "\\":
        return stack[:-1] + (STR_ESC,)
    return None if ch < " " else stack


def _escape(stack: Stack, ch: str) -> Stack | None:
    if ch in SIMPLE_ESCAPES:
        return stack[:-1] + (STR,)
    return stack[:-1] + (STR_U4,) if ch == "u" else None


def _hex_digit(stack: Stack, ch: str) -> Stack | None:
    if ch not in HEX_DIGITS:
        return None
    left = stack[-1]
    return stack[:-1] + (STR if left == STR_U1 else left - 1,)


def _number(stack: Stack, frame: int, ch: str) -> Stack | None:
    move = _NUMBER_MOVES[frame].get(ch)
    if move is not None:
        return stack[:-1] + (move,)
    if frame in _NUMBER_ENDS:  # the number is over: `ch` is the container's
        return _step(stack[:-1], ch)
    return None


_HANDLERS: dict[int, Callable[[Stack, str], Stack | None]] = {
    ROOT: _root, DONE: _done, OBJ_OPEN: _object_open, OBJ_KEY: _object_key, OBJ_COLON: _object_colon,
    OBJ_VALUE: _object_value, OBJ_NEXT: _object_next, ARR_OPEN: _array_open, ARR_VALUE: _array_value,
    ARR_NEXT: _array_next, STR: _string, STR_ESC: _escape, STR_U1: _hex_digit, STR_U2: _hex_digit,
    STR_U3: _hex_digit, STR_U4: _hex_digit,
}


@lru_cache(maxsize=4096)
def _next_chars(stack: Stack) -> frozenset[str] | None:
    if stack[-1] == STR:
        return None
    return frozenset(ch for ch in ASCII if _step(stack, ch) is not None)


# ---- shortest completions ---------------------------------------------------------------------

_CLOSINGS: dict[int, str] = {
    ROOT: "{}", DONE: "", OBJ_OPEN: "}", OBJ_KEY: '"":0}', OBJ_COLON: ":0}", OBJ_VALUE: "0}", OBJ_NEXT: "}",
    ARR_OPEN: "]", ARR_VALUE: "0]", ARR_NEXT: "]", STR: '"', STR_ESC: 'n"', STR_U1: '0"', STR_U2: '00"',
    STR_U3: '000"', STR_U4: '0000"', NUM_MINUS: "0", NUM_ZERO: "", NUM_INT: "", NUM_DOT: "0", NUM_FRAC: "",
    NUM_EXP: "0", NUM_EXP_SIGN: "0", NUM_EXP_DIGITS: "",
}


def _closing(frame: Frame) -> str:
    return frame if isinstance(frame, str) else _CLOSINGS[frame]
