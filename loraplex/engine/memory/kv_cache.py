"""Paged KV cache arithmetic shared by the memory policies."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
