"""Adapter sources and peer transfer: file://, https:// (plain HTTP here), the scheme allow-list, no
path traversal, the size limit, digest checks and single-flight fetching. The cloud schemes (s3://,
gs://, hf://) against local servers: test_cloud_sources.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import socket
import tarfile
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from loraplex_agent.cluster.fetcher import DIGEST_HEADER, AdapterFetcher
from loraplex_agent.cluster.files import (
    ADAPTER_FILES,
    SizeLimitError,
    adapter_digest,
    local_dir,
    tar_chunks,
    untar,
)
from loraplex_agent.cluster.limits import Budget
from loraplex_agent.cluster.settings import ClusterSettings
from loraplex_agent.cluster.sources import SourcePolicy, fetch_source
from threaded_server import ThreadedServer

from loraplex.routing.records import AdapterRecord
from loraplex.spec.errors import AdapterError, CommandError, InvalidRequestError

HTTP = SourcePolicy(frozenset({"file", "http", "s3", "gs", "hf"}))


@pytest.fixture
def adapter(tiny_model) -> Path:
    return next(iter(tiny_model.adapters.values()))


@pytest.fixture
def file_server(adapter, free_port):
    """GET /<anything>/<adapter file> serves the adapter's files and records each request."""
    app, seen = FastAPI(), []

    @app.get("/{path:path}")
    async def serve(path: str, request: Request) -> Response:
        seen.append((path, dict(request.headers)))
        name = path.rsplit("/", 1)[-1]
        if name not in ADAPTER_FILES:
            return Response(status_code=404)
        return FileResponse(adapter / name)

    with ThreadedServer(app, free_port()) as server:
        server.seen = seen
        yield server


def test_file_source_copies_the_two_files(adapter, tmp_path):
    fetch_source(f"file://{adapter}", tmp_path / "out", HTTP)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(ADAPTER_FILES)
    assert adapter_digest(tmp_path / "out") == adapter_digest(adapter)


def test_https_source_downloads_with_the_bearer_token(file_server, adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_SOURCE_TOKEN", "secret")
    fetch_source(f"{file_server.url}/adapters/sql", tmp_path / "out", HTTP)
    assert adapter_digest(tmp_path / "out") == adapter_digest(adapter)
    assert [p for p, _ in file_server.seen] == [f"adapters/sql/{n}" for n in ADAPTER_FILES]
    assert all(h["authorization"] == "Bearer secret" for _, h in file_server.seen)


def test_schemes_outside_the_allow_list_are_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="not allowed"):
        fetch_source("http://example.com/a", tmp_path, SourcePolicy())  # http is off by default
    with pytest.raises(InvalidRequestError, match="not allowed"):
        fetch_source("ftp://example.com/a", tmp_path, HTTP)


def test_remote_paths_never_climb(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"'\.\.'"):
        fetch_source("s3://bucket/a/../../etc", tmp_path, HTTP)
    with pytest.raises(InvalidRequestError, match=r"'\.\.'"):
        fetch_source("hf://org/repo/../x", tmp_path, HTTP)
    with pytest.raises(InvalidRequestError, match=r"'\.\.'"):
        fetch_source("gs://bucket/../x", tmp_path, HTTP)


@pytest.mark.parametrize("uri", ["s3:///no-bucket", "gs://bucket/a?versionId=1", "hf://just-org", "hf://org/repo@",
                                 "hf://org/re po", "hf://-org/repo"])
def test_malformed_cloud_sources_are_refused_before_any_request(uri, tmp_path):
    with pytest.raises(InvalidRequestError):
        fetch_source(uri, tmp_path, HTTP)


def test_adapter_names_cannot_escape_the_store(tmp_path):
    folder = local_dir(tmp_path, "../../etc/passwd", "sha256:" + "a" * 64)
    assert folder.parent == tmp_path.resolve()


def test_size_limit(adapter, file_server, tmp_path):
    small = SourcePolicy(HTTP.allowed_schemes, max_bytes=1000)
    with pytest.raises(SizeLimitError):
        fetch_source(f"file://{adapter}", tmp_path / "a", small)
    with pytest.raises(SizeLimitError):
        fetch_source(f"{file_server.url}/x", tmp_path / "b", small)


def test_the_budget_counts_every_byte_written(tmp_path):
    """Clients that write into a file object (google-cloud-storage) are cut off mid-stream."""
    budget = Budget(10)
    budget.declare(None, "unknown size")
    with pytest.raises(SizeLimitError, match="x is 11 bytes, over the adapter size limit of 10 bytes"):
        budget.declare(11, "x")
    with (tmp_path / "f").open("wb") as out:
        writer = budget.writer(out, "f")
        assert writer.write(b"12345678") == 8
        with pytest.raises(SizeLimitError, match="f is larger than the adapter size limit"):
            writer.write(b"123")


def test_tar_round_trip_and_hostile_archives(adapter, tmp_path):
    data = b"".join(tar_chunks(adapter))
    untar(io.BytesIO(data), tmp_path / "ok", 1 << 30)
    assert adapter_digest(tmp_path / "ok") == adapter_digest(adapter)
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        tar.add(str(adapter / ADAPTER_FILES[0]), arcname="../escape.json")
    evil.seek(0)
    with pytest.raises(AdapterError, match="unexpected entry"):
        untar(evil, tmp_path / "evil", 1 << 30)
    assert not (tmp_path / "escape.json").exists()


def _record(adapter: Path, source: str, digest: str | None = None) -> AdapterRecord:
    return AdapterRecord("sql", digest or adapter_digest(adapter), 8, 1, source)


@pytest.fixture
def peer(adapter, free_port, tmp_path):
    """A peer serving an adapter folder the way agents do; `.folder` can be swapped for a bad copy."""
    app, hits = FastAPI(), []

    @app.get("/v1/adapters/{name:path}/files")
    async def files(name: str) -> Response:
        hits.append(name)
        data = b"".join(tar_chunks(app.state.folder))
        return Response(data, media_type="application/x-tar",
                        headers={DIGEST_HEADER: adapter_digest(app.state.folder)})

    app.state.folder = adapter
    with ThreadedServer(app, free_port()) as server:
        server.app, server.hits = app, hits
        yield server


def test_fetch_prefers_a_peer_and_verifies_the_digest(adapter, peer, tmp_path):
    fetcher = AdapterFetcher(tmp_path / "store", HTTP)
    path = asyncio.run(fetcher.fetch(_record(adapter, "file:///nonexistent"), [peer.url]))
    assert adapter_digest(path) == adapter_digest(adapter) and peer.hits == ["sql"]


def test_a_peer_with_other_weights_is_skipped_for_the_source(adapter, peer, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    (other / ADAPTER_FILES[1]).write_bytes(b"not the weights")
    peer.app.state.folder = other
    fetcher = AdapterFetcher(tmp_path / "store", HTTP)
    path = asyncio.run(fetcher.fetch(_record(adapter, f"file://{adapter}"), [peer.url]))
    assert adapter_digest(path) == adapter_digest(adapter)


def test_a_peer_that_never_answers_is_passed_over_for_the_source(adapter, tmp_path):
    """A stopped peer: the kernel accepts the connection, nothing ever answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        policy = SourcePolicy(HTTP.allowed_schemes, peer_timeout_s=0.5)
        fetcher = AdapterFetcher(tmp_path / "store", policy)
        start = time.monotonic()
        path = asyncio.run(fetcher.fetch(_record(adapter, f"file://{adapter}"),
                                         [f"http://127.0.0.1:{silent.getsockname()[1]}"]))
    assert adapter_digest(path) == adapter_digest(adapter)
    assert time.monotonic() - start < 10.0  # the peer timeout, not the source's 60 s


def test_a_peer_that_trickles_is_dropped_for_the_source(adapter, free_port, tmp_path):
    """A peer that keeps the connection alive with a few bytes at a time never trips the read timeout;
    the rate floor drops it once the grace period is over."""
    app = FastAPI()

    @app.get("/v1/adapters/{name:path}/files")
    async def files(name: str) -> StreamingResponse:
        data = b"".join(tar_chunks(adapter))

        async def trickle():
            for start in range(0, len(data), 64):
                await asyncio.sleep(0.05)
                yield data[start:start + 64]

        return StreamingResponse(trickle(), media_type="application/x-tar",
                                 headers={DIGEST_HEADER: adapter_digest(adapter)})

    policy = SourcePolicy(HTTP.allowed_schemes, peer_timeout_s=0.5)
    fetcher = AdapterFetcher(tmp_path / "store", policy)
    with ThreadedServer(app, free_port()) as server:
        start = time.monotonic()
        path = asyncio.run(fetcher.fetch(_record(adapter, f"file://{adapter}"), [server.url]))
        took = time.monotonic() - start
    assert adapter_digest(path) == adapter_digest(adapter)
    assert took < 10.0  # the grace period, not the whole trickle (minutes)


def test_a_source_with_the_wrong_digest_is_refused(adapter, tmp_path):
    fetcher = AdapterFetcher(tmp_path / "store", HTTP)
    with pytest.raises(AdapterError, match="digest mismatch"):
        asyncio.run(fetcher.fetch(_record(adapter, f"file://{adapter}", "sha256:" + "0" * 64), []))
    assert [p.name for p in (tmp_path / "store").iterdir()] == []  # nothing half-installed


def test_concurrent_misses_share_one_fetch(adapter, peer, tmp_path):
    fetcher = AdapterFetcher(tmp_path / "store", HTTP)
    record = _record(adapter, "file:///nonexistent")

    async def many() -> list[Path]:
        return await asyncio.gather(*(fetcher.fetch(record, [peer.url]) for _ in range(5)))

    paths = asyncio.run(many())
    assert len(set(paths)) == 1 and peer.hits == ["sql"]


def _agent_args(**changes: object) -> argparse.Namespace:
    values = {"redis_url": "redis://127.0.0.1:1/0", "pool": "tiny", "server_id": "tiny-0", "advertise_url": None,
              "host": "127.0.0.1", "port": 8000, "adapter_store": None, "heartbeat_interval": 2.0,
              "heartbeat_ttl": 10.0, "source_schemes": "file,gs,hf,https,s3", "max_adapter_bytes": 4 << 30}
    return argparse.Namespace(**{**values, **changes})


def test_source_flags_are_checked(tmp_path):
    sources = ClusterSettings.from_args(_agent_args(source_schemes="S3, gs://,http")).sources
    assert sources.allowed_schemes == {"s3", "gs", "http"}
    for bad, message in (({"source_schemes": "s3,ftp"}, "unknown ftp"), ({"source_schemes": " , "}, "empty"),
                         ({"max_adapter_bytes": 0}, "at least 1"), ({"max_adapter_bytes": float("nan")}, "at least 1")):
        with pytest.raises(CommandError, match=message):
            ClusterSettings.from_args(_agent_args(**bad))
