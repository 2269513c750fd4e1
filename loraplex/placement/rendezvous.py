"""Rendezvous (highest-random-weight) hashing: every (adapter, server) pair gets a deterministic
score, and an adapter's servers in descending score are its preference order. Adding or removing a
server only changes the order of that server, so cold adapters placed by it rarely move. The
per-pair score mixes a hash of each name with splitmix64, vectorised over servers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def name_hash(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on 64-bit words that spreads every input bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9) & _MASK
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB) & _MASK
    return x ^ (x >> np.uint64(31))


def scores(adapters: Sequence[str], servers: Sequence[str]) -> np.ndarray:
    """`scores[i, j]`: the rendezvous weight of adapter i on server j (uint64)."""
    a = np.array([name_hash(n) for n in adapters], dtype=np.uint64).reshape(-1, 1)
    s = _mix(np.array([name_hash(n) for n in servers], dtype=np.uint64)).reshape(1, -1)
    return _mix(a ^ s)


def positions(adapters: Sequence[str], servers: Sequence[str]) -> np.ndarray:
    """`positions[i, j]`: where server j stands in adapter i's rendezvous order (0: first)."""
    order = np.argsort(scores(adapters, servers), axis=1, kind="stable")[:, ::-1]
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(order.shape[1])[None, :].repeat(order.shape[0], axis=0), axis=1)
    return pos
