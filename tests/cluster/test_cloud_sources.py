"""The cloud adapter sources through the clouds' own clients, against local servers:

- s3:// through boto3 against moto's S3/STS/IAM server, with request signing enforced: static keys,
  a named profile from the shared files, and EKS IRSA (a web identity token exchanged at STS); a
  public bucket without credentials; wrong keys, a missing object and the size limit as clear errors.
- gs:// through google-cloud-storage against gcp-storage-emulator: the emulator (anonymous), GKE
  Workload Identity (a token from a local metadata server), no credentials (anonymous), errors.
- hf:// through huggingface_hub against a local Hub (tests/support/cloud_fakes.py): revisions pinned
  to one commit, the token, the Hub cache, private / gated / missing repos.

Every test runs in an environment without any real credential, config file or metadata server, so
nothing here can reach a cloud."""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_fakes import HubRepo, fake_hub, fake_metadata_server
from loraplex_agent.cluster.files import ADAPTER_FILES, SizeLimitError, adapter_digest
from loraplex_agent.cluster.sources import SourcePolicy, fetch_source
from threaded_server import ThreadedServer
from tools import require_module

from loraplex.spec.errors import AdapterError

POLICY = SourcePolicy()
NO_AUTH = 10**9  # requests moto serves without checking signatures
for _client in ("boto3", "google.cloud.storage", "huggingface_hub", "moto.server", "gcp_storage_emulator.server"):
    require_module(_client, "pip install -e '.[agent,dev]'")
CLOUD_ENV = ("AWS_", "GOOGLE_", "GCE_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST", "API_ENDPOINT_OVERRIDE", "HF_",
             "HUGGING_FACE_")


@pytest.fixture
def adapter(tiny_model) -> Path:
    return next(iter(tiny_model.adapters.values()))


@pytest.fixture
def other_adapter(tiny_model) -> Path:
    return list(tiny_model.adapters.values())[1]


@pytest.fixture(autouse=True)
def no_real_cloud(monkeypatch, tmp_path, free_port) -> None:
    """No credential, config file, cache or metadata server of this machine is seen, and the metadata
    server Google's and AWS's clients would probe is a closed local port."""
    import os

    for name in list(os.environ):
        if name.startswith(CLOUD_ENV):
            monkeypatch.delenv(name)
    closed = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws" / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("GCE_METADATA_IP", closed)
    monkeypatch.setenv("GCE_METADATA_TIMEOUT", "1")
    from google.auth.compute_engine import _metadata
    from huggingface_hub import constants

    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", closed)  # read once, at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))


# ---- s3:// ------------------------------------------------------------------------------------


class MotoS3:
    """moto's server: S3, STS and IAM on one port; `enforce_auth()` makes it check every signature."""

    def __init__(self, port: int) -> None:
        from moto.server import ThreadedMotoServer

        self.url = f"http://127.0.0.1:{port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)

    def client(self, service: str, **credentials: str):
        import boto3

        keys = credentials or {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        return boto3.session.Session(**keys, region_name="us-east-1").client(service, endpoint_url=self.url)

    def auth(self, free_requests: int) -> None:
        """Requests without a valid signature are refused after `free_requests` more requests."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=str(free_requests).encode(),
                                         method="POST", headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture(scope="module")
def moto(tiny_model, free_port) -> Iterator[MotoS3]:
    """A bucket `adapters` with adapters under a/ and b/, a user `reader` and a role `adapter-reader`
    (trusted for web identity) that may read it, and a public bucket `open`."""
    server = MotoS3(free_port())
    server.server.start()
    server.auth(NO_AUTH)
    adapters = list(tiny_model.adapters.values())
    s3 = server.client("s3")
    for bucket in ("adapters", "open"):
        s3.create_bucket(Bucket=bucket)
    s3.put_bucket_policy(Bucket="open", Policy=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::open/*"}]}))
    for prefix, folder in (("a", adapters[0]), ("b", adapters[1])):
        for name in ADAPTER_FILES:
            s3.put_object(Bucket="adapters", Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())
            s3.put_object(Bucket="open", Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())
    read = json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]})
    iam = server.client("iam")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=read)
    server.reader = iam.create_access_key(UserName="reader")["AccessKey"]
    trust = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRoleWithWebIdentity",
                        "Principal": {"Federated": "arn:aws:iam::123456789012:oidc-provider/oidc.eks.local"}}]})
    role = iam.create_role(RoleName="adapter-reader", AssumeRolePolicyDocument=trust)["Role"]
    iam.put_role_policy(RoleName="adapter-reader", PolicyName="read", PolicyDocument=read)
    server.role_arn = role["Arn"]
    try:
        yield server
    finally:
        server.server.stop()


@pytest.fixture
def signed(moto, monkeypatch) -> MotoS3:
    """moto checks signatures from now on; the agent's SDK talks to it (AWS_ENDPOINT_URL)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    moto.auth(0)
    yield moto
    moto.auth(NO_AUTH)


def _same_adapter(folder: Path, expected: Path) -> bool:
    return adapter_digest(folder) == adapter_digest(expected) and sorted(p.name for p in folder.iterdir()) == sorted(
        ADAPTER_FILES)


def test_s3_with_keys_from_the_environment(signed, adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", signed.reader["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", signed.reader["SecretAccessKey"])
    fetch_source("s3://adapters/a", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", adapter)


def test_s3_with_a_profile_from_the_shared_files(signed, other_adapter, tmp_path, monkeypatch):
    """The config-file chain (profiles; SSO and credential_process profiles are read the same way)."""
    credentials = Path(tmp_path / "aws" / "credentials")
    credentials.parent.mkdir(parents=True, exist_ok=True)
    credentials.write_text(f"[adapters]\naws_access_key_id = {signed.reader['AccessKeyId']}\n"
                           f"aws_secret_access_key = {signed.reader['SecretAccessKey']}\n")
    monkeypatch.setenv("AWS_PROFILE", "adapters")
    fetch_source("s3://adapters/b/", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", other_adapter)


def test_s3_with_eks_irsa_web_identity(signed, adapter, tmp_path, monkeypatch):
    """IRSA: no keys at all, a projected service-account token and a role, exchanged at STS for
    temporary credentials that sign the S3 requests."""
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6c2VydmluZzphZ2VudCJ9.c2ln")
    monkeypatch.setenv("AWS_ROLE_ARN", signed.role_arn)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "agent")
    signed.auth(1)  # AssumeRoleWithWebIdentity is an unsigned call (moto would check it); S3 calls are checked
    fetch_source("s3://adapters/a", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", adapter)


def test_s3_wrong_keys_are_a_clear_error(signed, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", signed.reader["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(AdapterError, match=r"s3://adapters/a/adapter_config.json: access denied \(SignatureDoesNotMatch"):
        fetch_source("s3://adapters/a", tmp_path / "out", POLICY)


def test_s3_public_bucket_without_credentials(moto, adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.url)
    fetch_source("s3://open/a", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", adapter)


def test_s3_missing_objects_and_the_size_limit(moto, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.url)
    with pytest.raises(AdapterError, match=r"s3://open/nothing/adapter_config.json: not found \(NoSuchKey"):
        fetch_source("s3://open/nothing", tmp_path / "a", POLICY)
    with pytest.raises(AdapterError, match=r"s3://missing-bucket/a/adapter_config.json: not found \(NoSuchBucket"):
        fetch_source("s3://missing-bucket/a", tmp_path / "b", POLICY)
    with pytest.raises(SizeLimitError, match="over the adapter size limit of 100 bytes"):
        fetch_source("s3://open/a", tmp_path / "c", SourcePolicy(max_bytes=100))


def test_s3_unreachable_endpoint_is_a_clear_error(tmp_path, monkeypatch, free_port):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(AdapterError, match=r"s3://open/a/adapter_config.json: Could not connect"):
        fetch_source("s3://open/a", tmp_path / "out", SourcePolicy(timeout_s=2))


# ---- gs:// ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gcs(tiny_model, free_port) -> Iterator[str]:
    """gcp-storage-emulator with bucket `adapters`: adapters under a/ and b/."""
    from gcp_storage_emulator.server import create_server
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="adapters")
    server.start()
    url = f"http://127.0.0.1:{port}"
    client = storage.Client(project="setup", credentials=AnonymousCredentials(), client_options={"api_endpoint": url})
    bucket = client.bucket("adapters")
    for prefix, folder in zip("ab", list(tiny_model.adapters.values())[:2], strict=True):
        for name in ADAPTER_FILES:
            bucket.blob(f"{prefix}/{name}").upload_from_filename(str(folder / name))
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def metadata(monkeypatch, free_port) -> Iterator:
    """A GKE metadata server with Workload Identity, where Google's client libraries look for it."""
    from google.auth.compute_engine import _metadata

    app = fake_metadata_server()
    with ThreadedServer(app, free_port()) as server:
        host = server.url.removeprefix("http://")
        monkeypatch.setenv("GCE_METADATA_IP", host)
        monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)
        yield app


def test_gs_against_the_emulator(gcs, adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs)
    fetch_source("gs://adapters/a", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", adapter)


def test_gs_with_gke_workload_identity(gcs, metadata, other_adapter, tmp_path, monkeypatch):
    """No key file: the token comes from the metadata server (Application Default Credentials)."""
    monkeypatch.setenv("API_ENDPOINT_OVERRIDE", gcs)
    fetch_source("gs://adapters/b", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", other_adapter)
    paths = [path for _, path, _ in metadata.state.seen]
    assert "/computeMetadata/v1/instance/service-accounts/default/token" in paths


def test_gs_without_credentials_goes_anonymous(gcs, metadata, adapter, tmp_path, monkeypatch):
    metadata.state.on_gce = False
    monkeypatch.setenv("API_ENDPOINT_OVERRIDE", gcs)
    fetch_source("gs://adapters/a", tmp_path / "out", POLICY)
    assert _same_adapter(tmp_path / "out", adapter)
    assert not any(path.endswith("/token") for _, path, _ in metadata.state.seen)


def test_gs_missing_objects_and_the_size_limit(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs)
    with pytest.raises(AdapterError, match=r"gs://adapters/nothing/adapter_config.json: not found"):
        fetch_source("gs://adapters/nothing", tmp_path / "a", POLICY)
    with pytest.raises(SizeLimitError, match="over the adapter size limit of 100 bytes"):
        fetch_source("gs://adapters/a", tmp_path / "b", SourcePolicy(max_bytes=100))


def test_gs_budget_covers_both_files(gcs, adapter, tmp_path, monkeypatch):
    """A budget that the config fits but not config + weights: refused before the weights download."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs)
    config_size = (adapter / ADAPTER_FILES[0]).stat().st_size
    with pytest.raises(SizeLimitError, match=f"gs://adapters/a/{ADAPTER_FILES[1]} is"):
        fetch_source("gs://adapters/a", tmp_path / "out", SourcePolicy(max_bytes=config_size + 10))


# ---- hf:// ------------------------------------------------------------------------------------

MAIN, V1 = "a" * 40, "b" * 40


def _files(folder: Path, subfolder: str = "") -> dict[str, bytes]:
    return {f"{subfolder}/{name}".lstrip("/"): (folder / name).read_bytes() for name in ADAPTER_FILES}


@pytest.fixture
def hub(adapter, other_adapter, free_port, monkeypatch) -> Iterator:
    repos = {
        "org/sql": HubRepo(refs={"main": MAIN, "v1": V1},
                           files={MAIN: _files(adapter, "lora"), V1: _files(other_adapter, "lora")}),
        "org/private": HubRepo(refs={"main": MAIN}, files={MAIN: _files(adapter)}, token="hf_secret"),
        "org/gated": HubRepo(refs={"main": MAIN}, files={MAIN: _files(adapter)}, gated=True),
    }
    app = fake_hub(repos)
    with ThreadedServer(app, free_port()) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield app


def test_hf_revision_subfolder_and_one_commit(hub, adapter, other_adapter, tmp_path):
    fetch_source("hf://org/sql/lora", tmp_path / "main", POLICY)
    assert _same_adapter(tmp_path / "main", adapter)
    hub.state.seen.clear()
    fetch_source("hf://org/sql/lora@v1", tmp_path / "v1", POLICY)
    assert _same_adapter(tmp_path / "v1", other_adapter)
    revisions = {name: {p.split("/")[4] for _, p, _ in hub.state.seen if p.endswith(name)} for name in ADAPTER_FILES}
    assert revisions == {ADAPTER_FILES[0]: {"v1"}, ADAPTER_FILES[1]: {V1}}  # the second file: the first one's commit


def test_hf_files_come_from_the_hub_cache(hub, adapter, tmp_path):
    fetch_source("hf://org/sql/lora", tmp_path / "first", POLICY)
    hub.state.seen.clear()
    fetch_source("hf://org/sql/lora", tmp_path / "second", POLICY)
    assert _same_adapter(tmp_path / "second", adapter)
    assert {method for method, _, _ in hub.state.seen} == {"HEAD"}  # where "main" is now; no download


def test_hf_private_repository_needs_the_token(hub, adapter, tmp_path, monkeypatch):
    with pytest.raises(AdapterError, match="hf://org/private: repository not found, or private"):
        fetch_source("hf://org/private", tmp_path / "a", POLICY)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    fetch_source("hf://org/private", tmp_path / "b", POLICY)
    assert _same_adapter(tmp_path / "b", adapter)
    assert {auth for _, _, auth in hub.state.seen} >= {"Bearer hf_secret"}


@pytest.mark.parametrize(("uri", "message"), [
    ("hf://org/gated", "the repository is gated"),
    ("hf://org/sql/lora@v9", "revision 'v9' not found"),
    ("hf://org/sql/other", r"hf://org/sql/other: not found"),
    ("hf://org/nothing", "repository not found"),
])
def test_hf_errors_are_clear(hub, tmp_path, uri, message):
    with pytest.raises(AdapterError, match=message):
        fetch_source(uri, tmp_path / "out", POLICY)


def test_hf_size_limit_before_downloading(hub, tmp_path):
    with pytest.raises(SizeLimitError, match="over the adapter size limit of 100 bytes"):
        fetch_source("hf://org/sql/lora", tmp_path / "out", SourcePolicy(max_bytes=100))
    assert all(method == "HEAD" for method, _, _ in hub.state.seen)


def test_hf_offline_serves_the_cache_and_says_what_is_missing(hub, adapter, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE: what the cache holds is served without a request; anything else is a clear
    error (as when the Hub cannot be reached)."""
    from huggingface_hub import constants

    fetch_source("hf://org/sql/lora", tmp_path / "online", POLICY)
    hub.state.seen.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fetch_source("hf://org/sql/lora", tmp_path / "offline", POLICY)
    assert _same_adapter(tmp_path / "offline", adapter) and hub.state.seen == []
    with pytest.raises(AdapterError, match=r"hf://org/sql/lora@v1: the Hub at http://127.0.0.1:\d+ could not be read"
                                           r".*the Hub cache has no copy"):
        fetch_source("hf://org/sql/lora@v1", tmp_path / "v1", POLICY)


def test_digest_is_still_checked_after_a_cloud_fetch(hub, adapter, tmp_path):
    """The fetcher verifies what a cloud source returned, whichever client fetched it."""
    import asyncio

    from loraplex_agent.cluster.fetcher import AdapterFetcher

    from loraplex.routing.records import AdapterRecord

    fetcher = AdapterFetcher(tmp_path / "store", POLICY)
    wrong = AdapterRecord("sql", "sha256:" + hashlib.sha256(b"other").hexdigest(), 8, 1, "hf://org/sql/lora")
    with pytest.raises(AdapterError, match="digest mismatch"):
        asyncio.run(fetcher.fetch(wrong, []))
    right = AdapterRecord("sql", adapter_digest(adapter), 8, 1, "hf://org/sql/lora")
    assert _same_adapter(asyncio.run(fetcher.fetch(right, [])), adapter)
    shutil.rmtree(tmp_path / "store")


def test_broken_credential_settings_are_clear_errors(tmp_path, monkeypatch):
    """Configured but unusable credentials are reported, never silently replaced by anonymous access."""
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(AdapterError, match="s3://open/a: The config profile \\(no-such-profile\\) could not be found"):
        fetch_source("s3://open/a", tmp_path / "a", POLICY)
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/adapter-reader")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "missing-token"))
    with pytest.raises(AdapterError, match="s3://open/a/adapter_config.json: .*missing-token"):
        fetch_source("s3://open/a", tmp_path / "b", POLICY)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    with pytest.raises(AdapterError, match="gs://adapters/a: .*missing-key.json"):
        fetch_source("gs://adapters/a", tmp_path / "c", POLICY)
