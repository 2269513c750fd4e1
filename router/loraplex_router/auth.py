"""Optional API keys, each with the list of adapters it may use.

Key file (YAML or JSON):

    keys:
      - key: sk-team-a          # or `key_env: TEAM_A_KEY` to read it from the environment
        adapters: [sql-expert, summarizer]    # "*" or absent: every adapter
        base_model: true                      # may call the base model (default true)
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from loraplex.spec.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError, one_line


@dataclass(frozen=True)
class ApiKey:
    key: str
    adapters: frozenset[str] | None  # None: every adapter
    base_model: bool = True

    def allows(self, adapter: str | None) -> bool:
        if adapter is None:
            return self.base_model
        return self.adapters is None or adapter in self.adapters


class KeyRing:
    """No keys configured means no authentication."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self._keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key of a request (None when authentication is off); raises 401 on a missing or wrong key."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        for key in self._keys:
            if hmac.compare_digest(key.key.encode(), token.strip().encode()):
                return key
        raise AuthenticationError("invalid API key", code="invalid_api_key")

    @staticmethod
    def check(key: ApiKey | None, adapter: str | None, model: str) -> None:
        if key is not None and not key.allows(adapter):
            raise PermissionDeniedError(f"this API key may not use model {model!r}", param="model",
                                        code="model_not_allowed")


def load_keys(path: str | Path) -> KeyRing:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequestError(f"cannot read API key file {path}: {one_line(exc)}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise InvalidRequestError(f"API key file {path}: expected a mapping with a 'keys' list")
    return KeyRing(_parse_key(item, path) for item in doc["keys"])


def _parse_key(item: object, path: str | Path) -> ApiKey:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"API key file {path}: every entry must be a mapping, got {item!r}")
    key = item.get("key") or os.environ.get(str(item.get("key_env", "")), "")
    if not key:
        raise InvalidRequestError(f"API key file {path}: an entry has neither 'key' nor a set 'key_env'")
    adapters = item.get("adapters", "*")
    if adapters != "*" and not (isinstance(adapters, list) and all(isinstance(a, str) for a in adapters)):
        raise InvalidRequestError(f"API key file {path}: 'adapters' must be '*' or a list of names")
    return ApiKey(str(key), None if adapters == "*" else frozenset(adapters), bool(item.get("base_model", True)))
