"""AWS Signature Version 4 for S3 GET requests, so `s3://` sources need no boto3.

Credentials come from the standard environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
optional AWS_SESSION_TOKEN); the region from AWS_REGION or AWS_DEFAULT_REGION (default us-east-1);
an S3-compatible endpoint (MinIO, R2, ...) from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, addressed
path-style. The payload of a GET is empty, so its hash is a constant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote, urlsplit

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str | None = None

    @classmethod
    def from_env(cls) -> Credentials | None:
        access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not access or not secret:
            return None
        return cls(access, secret, os.environ.get("AWS_SESSION_TOKEN") or None)


def s3_object_url(bucket: str, key: str) -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    path = quote(key, safe="/~")
    if endpoint:
        return f"{endpoint.rstrip('/')}/{bucket}/{path}"
    return f"https://{bucket}.s3.{region()}.amazonaws.com/{path}"


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def sign_get(url: str, credentials: Credentials, region_name: str, now: datetime | None = None,
             extra_headers: dict[str, str] | None = None) -> dict[str, str]:
    """The headers that authenticate `GET url` (no query string) for service s3."""
    now = now or datetime.now(timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    parts = urlsplit(url)
    headers = {"host": parts.netloc, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date,
               **{k.lower(): v.strip() for k, v in (extra_headers or {}).items()}}
    if credentials.session_token:
        headers["x-amz-security-token"] = credentials.session_token
    signed = sorted(headers)
    canonical = "\n".join(["GET", parts.path or "/", "", *(f"{h}:{headers[h]}" for h in signed), "",
                           ";".join(signed), EMPTY_SHA256])
    scope = f"{day}/{region_name}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _signing_key(credentials.secret_key, day, region_name)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(signed)}, Signature={signature}")
    del headers["host"]  # the HTTP client sends it
    return headers


def _signing_key(secret: str, day: str, region_name: str) -> bytes:
    key = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
    for part in (region_name, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key
