"""Adapter folders on disk: digests, safe local paths, and the tar format peers exchange.

Only the two files of a PEFT adapter travel (adapter_config.json, adapter_model.safetensors), so a
tar from a peer can never write anything else, anywhere else.
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

from loraplex.spec.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_CHUNK = 1 << 20


class SizeLimitError(AdapterError):
    """An adapter larger than the agent accepts."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def adapter_digest(folder: Path) -> str:
    """An adapter's identity digest: sha256 of its weights file (as the engine computes it)."""
    return file_digest(folder / WEIGHTS_FILE)


def local_dir(root: Path, name: str, digest: str) -> Path:
    """Where an adapter version lives under `root`. Names may hold '/' or '..'; the folder name is
    made of safe characters only and checked to stay under `root`."""
    hexpart = digest.removeprefix("sha256:")[:16]
    if not re.fullmatch(r"[0-9a-f]{1,16}", hexpart):
        raise AdapterError(f"bad digest {digest!r} for adapter {name!r}")
    folder = (root / f"{_UNSAFE.sub('_', name).strip('.') or 'adapter'}-{hexpart}").resolve()
    if not folder.is_relative_to(root.resolve()):
        raise AdapterError(f"adapter name {name!r} escapes the adapter store")
    return folder


def verify(folder: Path, expected_digest: str) -> None:
    for name in ADAPTER_FILES:
        if not (folder / name).is_file():
            raise AdapterError(f"fetched adapter is missing {name}")
    actual = adapter_digest(folder)
    if actual != expected_digest:
        raise AdapterError(f"digest mismatch: expected {expected_digest}, got {actual}")


def install(staging: Path, final: Path) -> Path:
    """Move a verified staging folder into place (a concurrent identical install wins harmlessly)."""
    if final.exists():
        shutil.rmtree(staging, ignore_errors=True)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(final)
    return final


def tar_chunks(folder: Path) -> Iterator[bytes]:
    """The adapter's files as an uncompressed tar, produced in chunks (weights compress badly)."""
    buffer = _DrainBuffer()
    with tarfile.open(fileobj=buffer, mode="w|") as tar:
        for name in ADAPTER_FILES:
            path = folder / name
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with path.open("rb") as f:
                tar.addfile(info, f)
            yield buffer.drain()
    yield buffer.drain()


def untar(data: io.BufferedIOBase, dest: Path, max_bytes: int) -> None:
    """Extract a peer's tar into `dest`: regular files named like adapter files only, size-limited."""
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    with tarfile.open(fileobj=data, mode="r|") as tar:
        for member in tar:
            if member.name not in ADAPTER_FILES or not member.isreg():
                raise AdapterError(f"unexpected entry {member.name!r} in an adapter archive")
            total += member.size
            if total > max_bytes:
                raise SizeLimitError(f"adapter archive is larger than the limit of {max_bytes} bytes")
            source = tar.extractfile(member)
            with (dest / member.name).open("wb") as out:
                shutil.copyfileobj(source, out, _CHUNK)


class _DrainBuffer(io.RawIOBase):
    """A write-only sink whose content is taken out in pieces (tarfile's stream mode writes to it)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out
