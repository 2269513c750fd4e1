"""s3:// adapter sources through boto3, the AWS SDK, so credentials come from its standard chain, as
for the AWS CLI: environment variables, the shared config and credentials files (profiles, AWS_PROFILE,
IAM Identity Center / SSO, credential_process), web identity tokens (EKS IRSA:
AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE), container credentials (EKS Pod Identity, ECS) and the
instance profile (IMDS). The region and the endpoint follow the SDK too (AWS_REGION, AWS_ENDPOINT_URL_S3
or AWS_ENDPOINT_URL for MinIO, R2 or a local S3). With no credentials at all the request goes
unsigned (public buckets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.spec.errors import AdapterError
from loraplex_agent.cluster.files import ADAPTER_FILES
from loraplex_agent.cluster.limits import Budget

_CHUNK = 1 << 20
_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "AllAccessDisabled"}


def fetch(bucket: str, prefix: str, dest: Path, budget: Budget, timeout_s: float) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    where = f"s3://{bucket}/{prefix}"
    try:
        client = _client(timeout_s)
        for name in ADAPTER_FILES:
            key = f"{prefix}/{name}" if prefix else name
            where = f"s3://{bucket}/{key}"
            _get(client, bucket, key, dest / name, budget)
    except ClientError as exc:
        raise _client_error(exc, where) from exc
    except (BotoCoreError, OSError) as exc:  # unreachable, a broken profile or token file, timeouts, ...
        raise AdapterError(f"{where}: {exc}") from exc


def _client(timeout_s: float) -> Any:
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"mode": "standard"})
    if session.get_credentials() is None:
        config = config.merge(Config(signature_version=UNSIGNED))
    return session.client("s3", config=config)


def _get(client: Any, bucket: str, key: str, path: Path, budget: Budget) -> None:
    """Stream one object to `path` under the budget (its declared length is checked first)."""
    what = f"s3://{bucket}/{key}"
    response = client.get_object(Bucket=bucket, Key=key)
    body = response["Body"]
    try:
        budget.declare(response.get("ContentLength"), what)
        with path.open("wb") as out:
            for chunk in body.iter_chunks(_CHUNK):
                budget.take(len(chunk), what)
                out.write(chunk)
    finally:
        body.close()


def _client_error(exc: Any, where: str) -> AdapterError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    detail = f"{code}: {error.get('Message') or 'no message'}"
    if code in _MISSING:
        return AdapterError(f"{where}: not found ({detail}); an adapter folder holds {' and '.join(ADAPTER_FILES)}")
    if code in _DENIED:
        return AdapterError(f"{where}: access denied ({detail}); the agent's AWS credentials (environment, "
                            "profile, IRSA, Pod Identity or instance profile) need s3:GetObject on it")
    return AdapterError(f"{where}: {detail}")
