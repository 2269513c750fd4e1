"""What an agent accepts as an adapter source, and the byte budget every fetch draws from
(import-light: the CLI reads the defaults; the cloud clients are imported only when used)."""

from __future__ import annotations

from typing import BinaryIO

from loraplex_agent.cluster.files import SizeLimitError

DEFAULT_SCHEMES = frozenset({"file", "https", "s3", "gs", "hf"})
DEFAULT_MAX_BYTES = 4 << 30


class Budget:
    """Bytes an adapter may still take: each of its files draws from the same budget, whatever the
    source says about sizes (a declared size is checked before anything is read, and every byte
    written is counted)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.left = max_bytes

    def declare(self, size: int | None, what: str) -> None:
        """Refuse a file whose announced size is over what is left (None: unknown, counted as read)."""
        if size is not None and size > self.left:
            raise SizeLimitError(f"{what} is {size} bytes, over the adapter size limit of {self.max_bytes} bytes")

    def take(self, size: int, what: str) -> None:
        self.left -= size
        if self.left < 0:
            raise SizeLimitError(f"{what} is larger than the adapter size limit of {self.max_bytes} bytes")

    def writer(self, out: BinaryIO, what: str) -> BudgetWriter:
        return BudgetWriter(out, self, what)


class BudgetWriter:
    """A write-only file that counts every byte against a Budget before passing it on (for clients
    that download into a file object)."""

    def __init__(self, out: BinaryIO, budget: Budget, what: str) -> None:
        self._out, self._budget, self._what = out, budget, what

    def write(self, data: bytes) -> int:
        self._budget.take(len(data), self._what)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._out.tell()
