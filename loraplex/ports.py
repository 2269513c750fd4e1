"""Free TCP ports on 127.0.0.1 for the processes a local stack or a benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of `count` consecutive ports that are free now (the agents of a stack listen on a block)."""
    for _ in range(100):
        first = free_port()
        if first + count < 65000 and all(_is_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no block of {count} free ports on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
