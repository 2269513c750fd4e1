"""hf:// adapter sources through huggingface_hub, the Hub's own client: the token is the Hub's
(HF_TOKEN, or the one `hf auth login` stored), the endpoint HF_ENDPOINT (a mirror or a private Hub),
files land in the Hub cache (HF_HOME / HF_HUB_CACHE; the operator points HF_HOME at the pod's model
volume) and are copied from there, and a branch or tag is resolved to one commit first, so both files
come from the same commit even while someone pushes. HF_HUB_OFFLINE=1 serves from the cache only."""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.spec.errors import AdapterError
from loraplex_agent.cluster.files import ADAPTER_FILES
from loraplex_agent.cluster.limits import Budget

_CHUNK = 1 << 20


def fetch(repo: str, subfolder: str, revision: str | None, dest: Path, budget: Budget, timeout_s: float) -> None:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hf://{repo}/{subfolder}".rstrip("/") + (f"@{revision}" if revision else "")
    try:
        commit = None
        for name in ADAPTER_FILES:
            commit = _get(repo, subfolder, commit or revision, name, dest / name, budget, timeout_s)
    except GatedRepoError as exc:
        raise AdapterError(f"{where}: the repository is gated; accept its terms on the Hub with the account "
                           "whose token the agent uses (HF_TOKEN)") from exc
    except RepositoryNotFoundError as exc:  # also what the Hub answers for a private repo without access
        raise AdapterError(f"{where}: repository not found, or private and HF_TOKEN gives no access") from exc
    except RevisionNotFoundError as exc:
        raise AdapterError(f"{where}: revision {revision!r} not found") from exc
    except RemoteEntryNotFoundError as exc:
        raise AdapterError(f"{where}: not found; an adapter folder holds {' and '.join(ADAPTER_FILES)}") from exc
    except LocalEntryNotFoundError as exc:  # the Hub did not answer usefully, and the cache has no copy
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise AdapterError(f"{where}: the Hub at {_endpoint() or 'https://huggingface.co'} could not be read"
                           f"{cause} and the Hub cache has no copy") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise AdapterError(f"{where}: {exc}") from exc


def _endpoint() -> str | None:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _get(repo: str, subfolder: str, revision: str | None, name: str, path: Path, budget: Budget,
         timeout_s: float) -> str:
    """One file into `path` through the Hub cache, under the budget; returns the commit it came from."""
    from huggingface_hub import hf_hub_download

    where = f"hf://{repo}/{subfolder}/{name}" if subfolder else f"hf://{repo}/{name}"
    common = {"repo_id": repo, "filename": name, "subfolder": subfolder or None, "revision": revision,
              "endpoint": _endpoint(), "etag_timeout": timeout_s}
    info = hf_hub_download(**common, dry_run=True)  # size and commit, before any byte is downloaded
    budget.declare(info.file_size, where)
    cached = Path(hf_hub_download(**common))  # by the name asked for, so the cache learns the revision
    _copy(cached, path, budget, where)
    return _snapshot_commit(cached) or info.commit_hash


def _snapshot_commit(cached: Path) -> str | None:
    """The commit of a file in the Hub cache (.../snapshots/<commit>/<path>)."""
    parts = cached.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


def _copy(source: Path, path: Path, budget: Budget, what: str) -> None:
    with source.open("rb") as src, path.open("wb") as out:
        while chunk := src.read(_CHUNK):
            budget.take(len(chunk), what)
            out.write(chunk)
