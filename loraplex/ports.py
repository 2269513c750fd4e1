"""Free TCP ports on 127.0.0.1 for the processes a local stack or a benchmark starts."""

from __future__ import annotations

import os
import socket
from pathlib import Path


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


def in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Something listens on `port` at `host` (SO_REUSEADDR, as the servers bind: a closed connection
    waiting out TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listener(port: int) -> str | None:
    """'pid N: command line' of the process listening on TCP `port`, when this machine says (Linux /proc,
    own processes only); None when unknown."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _holds_socket(proc, inodes):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmdline = "?"
            return f"pid {proc.name}: {cmdline if len(cmdline) <= 120 else cmdline[:119] + '…'}"
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _holds_socket(proc: Path, inodes: set[str]) -> bool:
    try:
        return any(os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes
                   for fd in (proc / "fd").iterdir())
    except OSError:
        return False
