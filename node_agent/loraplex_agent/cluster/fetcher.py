"""Getting an adapter version into the local store: from a peer that holds it, else from its source.

One fetch per adapter version at a time (single-flight): concurrent misses wait for the same
fetch. Every copy is verified against the registry's digest before it is installed, so a bad peer
or a changed source can never serve other weights under the adapter's identity.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import httpx

from loraplex.routing.records import AdapterRecord
from loraplex.spec.errors import AdapterError, LoraplexError
from loraplex_agent.cluster.files import install, local_dir, untar, verify
from loraplex_agent.cluster.sources import SourcePolicy, fetch_source

log = logging.getLogger(__name__)
DIGEST_HEADER = "x-loraplex-digest"


class AdapterFetcher:
    def __init__(self, root: Path, policy: SourcePolicy, api_key: str | None = None) -> None:
        self.root = root
        self.policy = policy
        self.api_key = api_key
        self._in_flight: dict[tuple[str, str], asyncio.Future[Path]] = {}
        root.mkdir(parents=True, exist_ok=True)

    def path_of(self, record: AdapterRecord) -> Path:
        return local_dir(self.root, record.name, record.digest)

    async def fetch(self, record: AdapterRecord, peers: Sequence[str]) -> Path:
        """The local folder of `record`'s version, fetched if needed. `peers` are base URLs to try first."""
        key = (record.name, record.digest)
        if key in self._in_flight:
            return await asyncio.shield(self._in_flight[key])
        future = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            path = await asyncio.to_thread(self._fetch_blocking, record, list(peers))
            future.set_result(path)
            return path
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters (if any) get it through the shield
            raise
        finally:
            del self._in_flight[key]

    def remove(self, record: AdapterRecord) -> None:
        shutil.rmtree(self.path_of(record), ignore_errors=True)

    def _fetch_blocking(self, record: AdapterRecord, peers: list[str]) -> Path:
        final = self.path_of(record)
        if final.is_dir():
            return final
        errors = []
        for peer in peers:
            try:
                return self._into_store(record, lambda d, p=peer: self._from_peer(p, record, d))
            except (LoraplexError, httpx.HTTPError, OSError) as exc:
                log.warning("fetching %s from peer %s failed: %s", record.name, peer, exc)
                errors.append(f"{peer}: {exc}")
        try:
            return self._into_store(record, lambda d: fetch_source(record.source, d, self.policy))
        except LoraplexError as exc:
            errors.append(f"{record.source}: {exc.message}")
            raise type(exc)(f"cannot fetch adapter {record.name!r}: {'; '.join(errors)}", exc.param) from exc
        except Exception as exc:  # a cloud client's error that its source module did not expect
            log.warning("fetching %s from %s failed", record.name, record.source, exc_info=True)
            errors.append(f"{record.source}: {type(exc).__name__}: {exc}")
        raise AdapterError(f"cannot fetch adapter {record.name!r}: {'; '.join(errors)}")

    def _into_store(self, record: AdapterRecord, download) -> Path:
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        try:
            download(staging)
            verify(staging, record.digest)
            return install(staging, self.path_of(record))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _from_peer(self, peer: str, record: AdapterRecord, dest: Path) -> None:
        url = f"{peer.rstrip('/')}/v1/adapters/{quote(record.name, safe='')}/files"
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.stream("GET", url, headers=headers, timeout=self.policy.peer_timeout_s) as response:
            if response.status_code != 200:
                raise AdapterError(f"peer answered {response.status_code}")
            if response.headers.get(DIGEST_HEADER) != record.digest:
                raise AdapterError(f"peer holds digest {response.headers.get(DIGEST_HEADER)}, "
                                   f"not {record.digest}")
            reader = _ResponseReader(response, self.policy.peer_timeout_s, self.policy.peer_min_bytes_per_s)
            untar(reader, dest, self.policy.max_bytes)


class _ResponseReader:
    """A file-like view of a streaming response body (tarfile's stream mode reads from it). Past
    `grace_s`, a body arriving slower than `min_bytes_per_s` on average raises AdapterError."""

    def __init__(self, response: httpx.Response, grace_s: float, min_bytes_per_s: float) -> None:
        self._chunks = response.iter_raw()
        self._buffer = b""
        self._grace_s = grace_s
        self._min_bytes_per_s = min_bytes_per_s
        self._started = time.monotonic()
        self._received = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buffer += chunk
            self._received += len(chunk)
            self._check_rate()
        if size < 0:
            out, self._buffer = self._buffer, b""
        else:
            out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out

    def _check_rate(self) -> None:
        elapsed = time.monotonic() - self._started
        if elapsed > self._grace_s and self._received < self._min_bytes_per_s * elapsed:
            raise AdapterError(f"peer sent {self._received} bytes in {elapsed:.1f} s, slower than "
                               f"{self._min_bytes_per_s:.0f} bytes/s")
