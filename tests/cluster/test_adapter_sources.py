"""Adapter sources and peer transfer: file://, https:// (plain HTTP here), hf://, s3:// (SigV4), the
scheme allow-list, no path traversal, the size limit, digest checks and single-flight fetching."""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from loraplex_agent.cluster import sigv4
from loraplex_agent.cluster.fetcher import DIGEST_HEADER, AdapterFetcher
from loraplex_agent.cluster.files import (
    ADAPTER_FILES,
    SizeLimitError,
    adapter_digest,
    local_dir,
    tar_chunks,
    untar,
)
from loraplex_agent.cluster.sources import SourcePolicy, fetch_source
from loraplex_router.threaded_server import ThreadedServer

from loraplex.routing.records import AdapterRecord
from loraplex.spec.errors import AdapterError, InvalidRequestError

HTTP = SourcePolicy(frozenset({"file", "http", "s3", "hf"}))


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


def test_hf_source_uses_the_resolve_url_and_hf_token(file_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", file_server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    fetch_source("hf://org/repo/sub@v1", tmp_path / "out", HTTP)
    assert [p for p, _ in file_server.seen] == [f"org/repo/resolve/v1/sub/{n}" for n in ADAPTER_FILES]
    assert file_server.seen[0][1]["authorization"] == "Bearer hf_x"


def test_s3_source_signs_path_style_requests(file_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", file_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    fetch_source("s3://bucket/adapters/sql", tmp_path / "out", HTTP)
    path, headers = file_server.seen[0]
    assert path == f"bucket/adapters/sql/{ADAPTER_FILES[0]}"
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/eu-west-1/s3/aws4_request" in headers["authorization"]


def test_sigv4_matches_the_aws_documentation_example():
    """'GET Object' example of the S3 SigV4 documentation (header-based auth)."""
    credentials = sigv4.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = sigv4.sign_get("https://examplebucket.s3.amazonaws.com/test.txt", credentials, "us-east-1",
                             datetime(2013, 5, 24, tzinfo=timezone.utc), {"Range": "bytes=0-9"})
    assert headers["authorization"].endswith(
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


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


def test_adapter_names_cannot_escape_the_store(tmp_path):
    folder = local_dir(tmp_path, "../../etc/passwd", "sha256:" + "a" * 64)
    assert folder.parent == tmp_path.resolve()


def test_size_limit(adapter, file_server, tmp_path):
    small = SourcePolicy(HTTP.allowed_schemes, max_bytes=1000)
    with pytest.raises(SizeLimitError):
        fetch_source(f"file://{adapter}", tmp_path / "a", small)
    with pytest.raises(SizeLimitError):
        fetch_source(f"{file_server.url}/x", tmp_path / "b", small)


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
