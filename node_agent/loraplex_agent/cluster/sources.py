"""Fetching an adapter folder from its source: file://, https://, s3://, hf:// (http:// on request).

Every scheme names a folder that holds the two PEFT files; only those two are fetched. Credentials
come from the environment, never from the URI: S3 from the AWS variables (see sigv4.py), Hugging
Face from HF_TOKEN (endpoint HF_ENDPOINT, default https://huggingface.co), plain HTTPS from
LORAPLEX_SOURCE_TOKEN as a bearer token. Each file is streamed to disk under a size limit.

    file:///data/adapters/sql-expert
    https://models.example.com/adapters/sql-expert
    s3://my-bucket/adapters/sql-expert
    hf://org/repo            hf://org/repo@revision            hf://org/repo/sub/folder@revision
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpx

from loraplex.spec.errors import AdapterError, InvalidRequestError
from loraplex_agent.cluster import sigv4
from loraplex_agent.cluster.files import ADAPTER_FILES, SizeLimitError
from loraplex_agent.cluster.limits import DEFAULT_MAX_BYTES, DEFAULT_SCHEMES

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourcePolicy:
    allowed_schemes: frozenset[str] = DEFAULT_SCHEMES
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = 60.0


def fetch_source(uri: str, dest: Path, policy: SourcePolicy) -> None:
    """Write the adapter files named by `uri` into the folder `dest` (created)."""
    scheme = urlsplit(uri).scheme.lower()
    if scheme not in policy.allowed_schemes:
        raise InvalidRequestError(f"adapter source scheme {scheme!r} is not allowed "
                                  f"(allowed: {sorted(policy.allowed_schemes)})", param="source")
    dest.mkdir(parents=True, exist_ok=True)
    if scheme == "file":
        _copy_local(Path(unquote(urlsplit(uri).path)), dest, policy.max_bytes)
        return
    urls, headers = _remote(uri, scheme)
    with httpx.Client(timeout=policy.timeout_s, follow_redirects=True) as client:
        budget = policy.max_bytes
        for name in ADAPTER_FILES:
            budget -= _download(client, urls(name), headers(urls(name)), dest / name, budget)


def _copy_local(folder: Path, dest: Path, max_bytes: int) -> None:
    if not folder.is_absolute():
        raise InvalidRequestError(f"file:// sources need an absolute path, got {str(folder)!r}", param="source")
    total = 0
    for name in ADAPTER_FILES:
        path = folder / name
        if not path.is_file():
            raise AdapterError(f"{path} does not exist: not a PEFT adapter folder")
        total += path.stat().st_size
        if total > max_bytes:
            raise SizeLimitError(f"adapter at {folder} is larger than the limit of {max_bytes} bytes")
        shutil.copyfile(path, dest / name)


Urls = Callable[[str], str]
Headers = Callable[[str], dict[str, str]]


def _remote(uri: str, scheme: str) -> tuple[Urls, Headers]:
    """For a remote scheme: file name -> URL, and URL -> request headers."""
    parts = urlsplit(uri)
    if scheme in ("https", "http"):
        base = uri.rstrip("/")
        token = os.environ.get("LORAPLEX_SOURCE_TOKEN")
        return (lambda name: f"{base}/{name}"), (lambda url: {"authorization": f"Bearer {token}"} if token else {})
    if scheme == "s3":
        bucket, prefix = parts.netloc, _clean_path(parts.path)
        if not bucket:
            raise InvalidRequestError(f"s3 source {uri!r} has no bucket", param="source")
        credentials = sigv4.Credentials.from_env()
        region = sigv4.region()

        def s3_headers(url: str) -> dict[str, str]:
            return sigv4.sign_get(url, credentials, region) if credentials else {}
        return (lambda name: sigv4.s3_object_url(bucket, f"{prefix}/{name}" if prefix else name)), s3_headers
    if scheme == "hf":
        return _huggingface(parts.netloc + parts.path)
    raise InvalidRequestError(f"unsupported adapter source scheme {scheme!r}", param="source")


def _huggingface(spec: str) -> tuple[Urls, Headers]:
    """hf://org/repo[/sub/folder][@revision] -> {HF_ENDPOINT}/org/repo/resolve/revision/[sub/]file."""
    path, _, revision = spec.partition("@")
    parts = _clean_path(path).split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise InvalidRequestError(f"hf source needs hf://org/repo, got hf://{spec}", param="source")
    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    base = f"{endpoint}/{repo}/resolve/{quote(revision or 'main', safe='')}"
    token = os.environ.get("HF_TOKEN")
    return ((lambda name: f"{base}/{sub}/{name}" if sub else f"{base}/{name}"),
            (lambda url: {"authorization": f"Bearer {token}"} if token else {}))


def _clean_path(path: str) -> str:
    """A source path without empty, '.' or '..' segments: remote paths never climb."""
    segments = [s for s in unquote(path).split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise InvalidRequestError(f"adapter source path {path!r} must not contain '.' or '..'", param="source")
    return "/".join(segments)


def _download(client: httpx.Client, url: str, headers: dict[str, str], path: Path, budget: int) -> int:
    """Stream one file to `path`; returns its size. Refuses to go over `budget` bytes."""
    written = 0
    with client.stream("GET", url, headers=headers) as response:
        if response.status_code != 200:
            raise AdapterError(f"GET {url} answered {response.status_code}: {response.read()[:200]!r}")
        declared = int(response.headers.get("content-length") or 0)
        if declared > budget:
            raise SizeLimitError(f"{url} is {declared} bytes, over the adapter size limit")
        with path.open("wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                written += len(chunk)
                if written > budget:
                    raise SizeLimitError(f"{url} is larger than the adapter size limit")
                out.write(chunk)
    return written
