"""Block tables for requests over the page pool (paged KV cache bookkeeping)."""

from __future__ import annotations

from loraplex.engine.page_pool import PageKind, PagePool
from loraplex.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more tokens; False if memory is short."""
        if request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
            return True  # the common decode step: the last block still has room
        needed = self.blocks_needed(request, num_new_tokens)
        pages = self.pool.allocate(needed, PageKind.KV)
        if pages is None:
            return False
        request.block_ids.extend(pages)
        return True

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
