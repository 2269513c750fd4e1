"""The host tier of the KV cache: blocks swapped out of device pages wait here in host memory.

A host page mirrors one device page across every layer (keys and values). When the device is CUDA
the host tensors are pinned, so that a host -> device copy can run asynchronously on the copy
engine's side stream while the compute stream keeps going.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from loraplex.engine.messages import KVCopy

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [num_pages, block_size, kv_heads, head_dim]: the executor's caches."""


class HostKVPool:
    """`num_pages` host pages of KV blocks, each the size of one device page across all layers."""

    def __init__(self, num_pages: int, num_layers: int, page_shape: Sequence[int], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        if num_pages < 0 or num_layers < 1:
            raise ValueError(f"a host KV pool needs num_pages >= 0 and num_layers >= 1, "
                             f"not {num_pages} and {num_layers}")
        self.pinned = pin_memory
        shape = (num_pages, *page_shape)
        # empty, not zeros: a host page is only ever read after a swap-out has filled it, and
        # zero-filling gigabytes of pinned memory would only slow the engine's start
        self.layers = [(torch.empty(shape, dtype=dtype, pin_memory=pin_memory),
                        torch.empty(shape, dtype=dtype, pin_memory=pin_memory)) for _ in range(num_layers)]

    @classmethod
    def like(cls, kv_caches: KVCaches, num_pages: int) -> HostKVPool:
        """A pool of `num_pages` pages shaped like the device caches, pinned when they live on CUDA."""
        keys = kv_caches[0][0]
        return cls(num_pages, len(kv_caches), keys.shape[1:], keys.dtype, pin_memory=keys.device.type == "cuda")

    @property
    def num_pages(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, keys and values: what one KVCopy moves."""
        keys = self.layers[0][0]
        return 2 * len(self.layers) * math.prod(keys.shape[1:]) * keys.element_size()

    def swap_out(self, kv_caches: KVCaches, copies: Sequence[KVCopy]) -> int:
        """Copy device pages to host pages and return the bytes moved, once the copy is complete:
        the scheduler hands the device pages to other requests right after."""
        moved = self._copy(kv_caches, copies, to_host=True)
        device = kv_caches[0][0].device
        if device.type == "cuda":
            # non-blocking into pinned memory returns before the data lands; the host page must be
            # whole before anything (a later swap-in on the side stream) reads it
            torch.cuda.current_stream(device).synchronize()
        return moved

    def swap_in(self, kv_caches: KVCaches, copies: Sequence[KVCopy]) -> int:
        """Enqueue host -> device copies on the current stream and return the bytes they move.

        On CUDA the copies are asynchronous (pinned source): run this inside a CopyEngine job, whose
        completion event says when the device pages hold the data. On the CPU it is done on return."""
        return self._copy(kv_caches, copies, to_host=False)

    def _copy(self, kv_caches: KVCaches, copies: Sequence[KVCopy], *, to_host: bool) -> int:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"the host pool has {len(self.layers)} layers, the device caches {len(kv_caches)}")
        self._check_pages(copies, kv_caches[0][0].shape[0])
        for device_page, host_page, count in coalesce(copies):
            for device_kv, host_kv in zip(kv_caches, self.layers, strict=True):
                for device_t, host_t in zip(device_kv, host_kv, strict=True):
                    on_device = device_t[device_page:device_page + count]
                    on_host = host_t[host_page:host_page + count]
                    dst, src = (on_host, on_device) if to_host else (on_device, on_host)
                    dst.copy_(src, non_blocking=self.pinned)
        return len(copies) * self.page_bytes

    def _check_pages(self, copies: Sequence[KVCopy], num_device_pages: int) -> None:
        # a slice past the end is silently short; fail with the page's number instead
        for copy in copies:
            if not 0 <= copy.device_page < num_device_pages:
                raise IndexError(f"device page {copy.device_page} is outside 0..{num_device_pages - 1}")
            if not 0 <= copy.host_page < self.num_pages:
                raise IndexError(f"host page {copy.host_page} is outside 0..{self.num_pages - 1}")


def coalesce(copies: Sequence[KVCopy]) -> list[tuple[int, int, int]]:
    """(device page, host page, count) runs of the copies, in order, that are consecutive on both
    sides: a swap of pages allocated together becomes one copy per tensor instead of one per page,
    which matters on CUDA where each copy is a launch."""
    runs: list[tuple[int, int, int]] = []
    for copy in copies:
        if runs:
            device_page, host_page, count = runs[-1]
            if copy.device_page == device_page + count and copy.host_page == host_page + count:
                runs[-1] = (device_page, host_page, count + 1)
                continue
        runs.append((copy.device_page, copy.host_page, 1))
    return runs
