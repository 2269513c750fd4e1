"""Adapter identity: a name plus the digest of its weights.

Prefix-cache keys, cache entries and routing entries use `AdapterId`, so an adapter uploaded again
under the same name never reuses state computed with the old weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,252}$")


def validate_adapter_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            f"invalid adapter name {name!r}: use 1-253 letters, digits, '.', '_', ':', '/' or '-', "
            "starting with a letter or digit")
    return name


@dataclass(frozen=True, order=True)
class AdapterId:
    name: str
    digest: str  # "sha256:<hex>" of the weights file

    def __str__(self) -> str:
        return f"{self.name}@{self.digest[:19]}"


@dataclass(frozen=True)
class AdapterInfo:
    """What policies need to know about an adapter; no tensors."""

    id: AdapterId
    rank: int
    size_bytes: int
    target_modules: tuple[str, ...] = field(default=())
    base_model: str | None = None
    source: str | None = None
    # activated LoRA (PEFT's `alora_invocation_tokens`): the delta applies only from the last
    # occurrence of these tokens in a prompt on; empty for a standard LoRA
    invocation_tokens: tuple[int, ...] = ()

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_tokens)
