"""Incremental detokenization and stop strings, on the tiny model's real tokenizer."""

from __future__ import annotations

import pytest
from loraplex_agent.api.detokenizer import IncrementalDetokenizer, StopStringMatcher
from transformers import AutoTokenizer

TEXTS = ["def main():\n    print('héllo wörld — ✓ 日本語')\n", "  spaces   and\ttabs\n\n", "🙂🙃 emoji"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model.base_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_decoding_equals_whole_decoding(tokenizer, text):
    prompt = tokenizer.encode("x = ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add([token]) for token in ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_are_not_part_of_the_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a"))
    ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(detokenizer.add([t]) for t in ids) + detokenizer.flush() == "hello"


def test_stop_string_split_across_deltas_is_cut_and_never_leaks():
    matcher = StopStringMatcher(("STOP",))
    released = [matcher.add(piece, final=False) for piece in ["abc S", "T", "OP and more"]]
    assert "".join(released) == "abc "
    assert matcher.stopped
    assert matcher.add("later", final=False) == ""


def test_the_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(("world", "lo"))
    assert matcher.add("hello world", final=False) == "hel"


def test_text_held_back_for_a_possible_stop_is_released_when_it_is_not_one():
    matcher = StopStringMatcher(("###",))
    assert matcher.add("ab#", final=False) == "a"
    assert matcher.add("#c", final=False) == "b#"
    assert matcher.add("d", final=True) == "#cd"
    assert not matcher.stopped


def test_without_stop_strings_everything_is_released_at_once():
    matcher = StopStringMatcher(())
    assert matcher.add("abc", final=False) == "abc"
