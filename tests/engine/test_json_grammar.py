"""The JSON-object prefix recognizer against `json.loads`: every prefix of a JSON object is
accepted, every accepted prefix can be completed (checked by `json.loads`), a whole object is
complete and nothing may follow it, and on arbitrary text the recognizer agrees with the parser."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from loraplex.engine.output.json_grammar import JsonPrefix, is_json_object, is_json_object_prefix

WHITESPACE = " \t\n\r"


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def loads_object(text: str) -> bool:
    """The oracle: one JSON object, nothing around it (JSON mode's rules), NaN and Infinity refused."""
    if not text or text[0] != "{" or text[-1] in WHITESPACE:
        return False
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict)


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                      max_leaves=12)
objects = st.dictionaries(st.text(max_size=6), values, max_size=5)


@st.composite
def documents(draw) -> str:
    """An object written the many ways a model could write it: spacing, indentation, escapes."""
    indent = draw(st.sampled_from([None, 0, 1, 2, "\t"]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " :"), (",\n", ":\t")]))
    return json.dumps(draw(objects), indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))


@given(documents())
@settings(max_examples=300, deadline=None)
def test_every_prefix_of_an_object_is_accepted_and_only_the_whole_is_complete(text):
    state = JsonPrefix.start()
    for i, ch in enumerate(text):
        assert not state.complete, text[:i]
        state = state.feed(ch)
        assert state is not None, (text[:i + 1], text)
    assert state.complete
    assert JsonPrefix.start().feed(text) == state  # one feed of the whole text equals char by char
    for extra in (" ", "\n", "}", ",", "0", "a"):
        assert state.feed(extra) is None  # nothing may follow the object


@given(documents(), st.data())
@settings(max_examples=300, deadline=None)
def test_an_accepted_prefix_completes_to_an_object(text, data):
    cut = data.draw(st.integers(0, len(text)))
    state = JsonPrefix.start().feed(text[:cut])
    assert state is not None
    completed = text[:cut] + state.closing()
    assert loads_object(completed), completed
    assert is_json_object(completed)


jsonish = st.text(alphabet=st.sampled_from(list('{}[]":,\\ \n\t0123456789-+.eEtrufalsnbu"ABCxé\x01')), max_size=24)


@given(jsonish)
@settings(max_examples=2000, deadline=None)
@example('{"a":1}')
@example('{"a":01}')
@example('{"a":-}')
@example('{"a":1.}')
@example('{"a":.5}')
@example('{"a":1e}')
@example('{"a":1e+}')
@example('{"a":"\\u12"}')
@example('{"a":"\\x"}')
@example('{"a":"\x01"}')
@example('{"a":tru}')
@example('{"a":[1,]}')
@example('{"a":1,}')
@example('{,}')
@example(' {}')
@example('{} ')
@example('{"a":NaN}')
@example('{"a":-Infinity}')
@example("[]")
def test_agrees_with_json_loads_on_arbitrary_text(text):
    assert is_json_object(text) == loads_object(text), text
    state = JsonPrefix.start()
    for i in range(len(text)):
        state = state.feed(text[i])
        if state is None:  # no extension can be accepted: the text itself is not an object
            assert not loads_object(text), text
            assert not is_json_object_prefix(text)
            return
        assert loads_object(text[:i + 1] + state.closing()), text[:i + 1]


@given(documents(), st.data())
@settings(max_examples=500, deadline=None)
def test_agrees_with_json_loads_on_mutated_objects(text, data):
    position = data.draw(st.integers(0, len(text)))
    insert = data.draw(st.sampled_from(list('{}[]":,\\ 0-.eE1tfnx\x00')))
    drop = data.draw(st.integers(0, 1))
    mutated = text[:position] + insert + text[position + drop:]
    assert is_json_object(mutated) == loads_object(mutated), mutated


def test_next_chars_are_exactly_the_characters_that_feed():
    for prefix in ('', '{', '{"a"', '{"a":', '{"a":1', '{"a":-', '{"a":[', '{"a":[1', '{"a":t', '{"a":"\\',
                   '{"a":"\\u0', '{"a":{}', '{"a":1.5e'):
        state = JsonPrefix.start().feed(prefix)
        expected = {chr(c) for c in range(128) if state.feed(chr(c)) is not None}
        assert state.next_chars() == expected, prefix
    assert JsonPrefix.start().feed('{"a').next_chars() is None  # inside a string: almost anything


def test_states_are_immutable_and_shared_by_equal_texts():
    start = JsonPrefix.start()
    state = start.feed('{"key": [1, 2')
    assert start.feed('{"key":[1,2') == state.feed("")
    assert state.feed("]}") is not None and state.feed("}") is None
    assert start == JsonPrefix.start() and not start.complete
    assert start.feed("") is start
