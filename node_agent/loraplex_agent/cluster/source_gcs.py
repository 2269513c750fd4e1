"""gs:// adapter sources through google-cloud-storage, so credentials come from Google's Application
Default Credentials, as for gcloud and every Google client: GOOGLE_APPLICATION_CREDENTIALS (a service
account key, or a workload identity federation config for pods on EKS, AKS or elsewhere), the gcloud
user credentials, and the metadata server (GKE Workload Identity, Compute Engine service accounts).
Downloads are checked against the object's CRC32C/MD5 by the client. STORAGE_EMULATOR_HOST points the
client at an emulator (anonymous), API_ENDPOINT_OVERRIDE at another endpoint with credentials. With
no credentials at all the request goes anonymous (public buckets)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loraplex.spec.errors import AdapterError
from loraplex_agent.cluster.files import ADAPTER_FILES
from loraplex_agent.cluster.limits import Budget


def fetch(bucket: str, prefix: str, dest: Path, budget: Budget, timeout_s: float) -> None:
    from google.api_core.exceptions import Forbidden, GoogleAPIError, NotFound, Unauthorized
    from google.auth.exceptions import GoogleAuthError
    from google.resumable_media.common import DataCorruption, InvalidResponse
    from requests.exceptions import RequestException

    where = f"gs://{bucket}/{prefix}"
    try:
        store = _client().bucket(bucket)
        for name in ADAPTER_FILES:
            key = f"{prefix}/{name}" if prefix else name
            where = f"gs://{bucket}/{key}"
            _get(store, key, dest / name, budget, timeout_s)
    except NotFound as exc:
        raise AdapterError(f"{where}: not found; an adapter folder holds {' and '.join(ADAPTER_FILES)}") from exc
    except (Forbidden, Unauthorized) as exc:
        raise AdapterError(f"{where}: access denied ({exc.message}); the agent's Google credentials (Workload "
                           "Identity, GOOGLE_APPLICATION_CREDENTIALS) need storage.objects.get on it") from exc
    except DataCorruption as exc:
        raise AdapterError(f"{where}: the download does not match the object's checksum") from exc
    except (GoogleAPIError, GoogleAuthError, InvalidResponse, RequestException) as exc:
        raise AdapterError(f"{where}: {exc}") from exc


def _client() -> Any:
    """A client with the Application Default Credentials; anonymous when none are configured (a
    configured GOOGLE_APPLICATION_CREDENTIALS that does not work is an error, not anonymous)."""
    import google.auth.exceptions
    from google.cloud import storage

    try:
        return storage.Client(project=None)  # downloads need no project; None skips guessing one
    except google.auth.exceptions.DefaultCredentialsError:
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            raise
        return storage.Client.create_anonymous_client()


def _get(bucket: Any, key: str, path: Path, budget: Budget, timeout_s: float) -> None:
    """Download one object to `path` under the budget (its metadata size is checked first)."""
    from google.api_core.exceptions import NotFound

    what = f"gs://{bucket.name}/{key}"
    blob = bucket.get_blob(key, timeout=timeout_s)
    if blob is None:
        raise NotFound(what)
    budget.declare(blob.size, what)
    with path.open("wb") as out:
        blob.download_to_file(budget.writer(out, what), timeout=timeout_s, checksum="auto")
