"""Fetching an adapter folder from its source: file://, https://, s3://, gs://, hf:// (http:// on request).

Every scheme names a folder that holds the two PEFT files; only those two are fetched, each under
the one byte budget of `--max-adapter-bytes`. Credentials never come from the URI: each cloud's own
client finds them the way that cloud's tools do (the standard credential chains), see
docs/router.md "Pool membership":

    file:///data/adapters/sql-expert
    https://models.example.com/adapters/sql-expert         bearer LORAPLEX_SOURCE_TOKEN
    s3://my-bucket/adapters/sql-expert                     boto3 (source_s3.py)
    gs://my-bucket/adapters/sql-expert                     google-cloud-storage (source_gcs.py)
    hf://org/repo   hf://org/repo@revision   hf://org/repo/sub/folder@revision     huggingface_hub (source_hf.py)

The URI is checked here (scheme allow-list, no '.' or '..' segments); the per-scheme modules only
transfer bytes. The fetcher checks the digest of what arrives before installing it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from loraplex.spec.errors import AdapterError, InvalidRequestError
from loraplex_agent.cluster.files import ADAPTER_FILES
from loraplex_agent.cluster.limits import DEFAULT_MAX_BYTES, DEFAULT_SCHEMES, Budget

_CHUNK = 1 << 20
_HF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")  # one half of a Hub repo id (org or name)


@dataclass(frozen=True)
class SourcePolicy:
    allowed_schemes: frozenset[str] = DEFAULT_SCHEMES
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = 60.0
    # A peer is in the cluster and streams from its local disk: one that sends nothing for this long
    # (stopped, overloaded) is passed over for the next peer or the source, not waited on for a minute.
    peer_timeout_s: float = 5.0
    # A peer that keeps sending, but slowly (a saturated NIC, a dying disk), would hold the fetch for
    # as long as it trickles: past the first `peer_timeout_s`, one averaging less than this is dropped.
    peer_min_bytes_per_s: float = float(1 << 20)


def fetch_source(uri: str, dest: Path, policy: SourcePolicy) -> None:
    """Write the adapter files named by `uri` into the folder `dest` (created). Raises
    InvalidRequestError for a URI that is refused, AdapterError (SizeLimitError) for a failed fetch."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in policy.allowed_schemes:
        raise InvalidRequestError(f"adapter source scheme {scheme!r} is not allowed "
                                  f"(allowed: {sorted(policy.allowed_schemes)})", param="source")
    dest.mkdir(parents=True, exist_ok=True)
    budget = Budget(policy.max_bytes)
    if scheme == "file":
        _copy_local(Path(unquote(parts.path)), dest, budget)
    elif scheme in ("https", "http"):
        _fetch_http(uri.rstrip("/"), dest, budget, policy.timeout_s)
    elif scheme == "s3":
        from loraplex_agent.cluster import source_s3

        source_s3.fetch(*bucket_and_prefix(uri), dest, budget, policy.timeout_s)
    elif scheme == "gs":
        from loraplex_agent.cluster import source_gcs

        source_gcs.fetch(*bucket_and_prefix(uri), dest, budget, policy.timeout_s)
    elif scheme == "hf":
        from loraplex_agent.cluster import source_hf

        repo, subfolder, revision = hf_location(uri)
        source_hf.fetch(repo, subfolder, revision, dest, budget, policy.timeout_s)
    else:
        raise InvalidRequestError(f"unsupported adapter source scheme {scheme!r}", param="source")


def bucket_and_prefix(uri: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    parts = urlsplit(uri)
    if not parts.netloc:
        raise InvalidRequestError(f"{parts.scheme} source {uri!r} has no bucket", param="source")
    if parts.query or parts.fragment:
        raise InvalidRequestError(f"{parts.scheme} source {uri!r} must not have a query or a fragment",
                                  param="source")
    return parts.netloc, clean_path(parts.path)


def hf_location(uri: str) -> tuple[str, str, str | None]:
    """hf://org/repo[/sub/folder][@revision] -> ("org/repo", "sub/folder", "revision" or None)."""
    spec = uri.split("://", 1)[1]
    path, at, revision = spec.partition("@")
    parts = clean_path(path).split("/")
    if len(parts) < 2 or not all(_HF_NAME.fullmatch(p) for p in parts[:2]) or (at and not revision):
        raise InvalidRequestError(f"hf source needs hf://org/repo[/folder][@revision], got {uri!r}", param="source")
    return "/".join(parts[:2]), "/".join(parts[2:]), revision or None


def clean_path(path: str) -> str:
    """A source path without empty, '.' or '..' segments: remote paths never climb."""
    segments = [s for s in unquote(path).split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise InvalidRequestError(f"adapter source path {path!r} must not contain '.' or '..'", param="source")
    return "/".join(segments)


def _copy_local(folder: Path, dest: Path, budget: Budget) -> None:
    if not folder.is_absolute():
        raise InvalidRequestError(f"file:// sources need an absolute path, got {str(folder)!r}", param="source")
    for name in ADAPTER_FILES:
        path = folder / name
        if not path.is_file():
            raise AdapterError(f"{path} does not exist: not a PEFT adapter folder")
        budget.take(path.stat().st_size, f"the adapter at {folder}")
        shutil.copyfile(path, dest / name)


def _fetch_http(base: str, dest: Path, budget: Budget, timeout_s: float) -> None:
    token = os.environ.get("LORAPLEX_SOURCE_TOKEN")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=timeout_s, follow_redirects=True, headers=headers) as client:
        for name in ADAPTER_FILES:
            _download(client, f"{base}/{name}", dest / name, budget)


def _download(client: httpx.Client, url: str, path: Path, budget: Budget) -> None:
    """Stream one file to `path` under the budget."""
    try:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise AdapterError(f"GET {url} answered {response.status_code}: {response.read()[:200]!r}")
            declared = response.headers.get("content-length")
            budget.declare(int(declared) if declared and declared.isdigit() else None, url)
            with path.open("wb") as out:
                for chunk in response.iter_bytes(_CHUNK):
                    budget.take(len(chunk), url)
                    out.write(chunk)
    except httpx.HTTPError as exc:
        raise AdapterError(f"GET {url} failed: {exc}") from exc
