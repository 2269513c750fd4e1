"""What one request adds to its adapter's demand: output plus the prompt tokens not predicted cached."""

from __future__ import annotations

import pytest

from loraplex.routing.demand import demand_tokens
from loraplex.routing.prefix import PrefixConfig, chunk_tokens


@pytest.mark.parametrize("prompt, output, blocks, block, expected", [
    (1000, 50, 0, 16, 1050),    # no match: every prompt token is work (other profiles pass no blocks)
    (1000, 50, 40, 16, 410),    # 40 blocks of 16 tokens predicted cached on the chosen server
    (1000, 50, 80, 16, 50),     # a prediction past the prompt is capped by it: the output is left
    (1000, 50, 3, 0, 1050),     # blocks of no tokens predict nothing
    (0, 0, 5, 16, 0),
])
def test_demand_tokens(prompt: int, output: int, blocks: int, block: int, expected: int) -> None:
    assert demand_tokens(prompt, output, blocks, block) == expected


def test_a_chunk_stands_for_a_block_of_tokens() -> None:
    assert chunk_tokens(PrefixConfig().chunk_chars) == 16  # 64 characters, about four a token
    assert chunk_tokens(4) == 1


@pytest.mark.parametrize("reported, expected", [(0, 1050), (640, 410), (992, 58), (5000, 50)])
def test_the_servers_reported_cached_tokens_replace_the_prediction(reported: int, expected: int) -> None:
    assert demand_tokens(1000, 50, 10, 16, reported_cached=reported) == expected
