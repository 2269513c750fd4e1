"""Which names a pool may have: one rule for the CRD, the local stack and the routing store.

An AdapterPool's name is the name of its headless Service, so it must be a DNS-1035 label (lowercase
letters, digits and '-', starting with a letter). It is also the name of its StatefulSet, whose pods
carry the label `controller-revision-hash: <name>-<hash of up to 10 characters>`; a label value has
at most 63 characters, so the name has at most 52.
"""

from __future__ import annotations

import re

# Anchored for CEL's `matches` (RE2 finds a match anywhere); Python uses it with `re.fullmatch`.
POOL_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_POOL_NAME_LENGTH = 52
_POOL_NAME = re.compile(POOL_NAME_PATTERN)


def is_pool_name(name: object) -> bool:
    return isinstance(name, str) and len(name) <= MAX_POOL_NAME_LENGTH and _POOL_NAME.fullmatch(name) is not None


def validate_pool_name(pool: str) -> str:
    """The name itself; ValueError when it cannot name a pool."""
    if not is_pool_name(pool):
        raise ValueError(f"invalid pool name {pool!r}: use a DNS-1035 label of at most {MAX_POOL_NAME_LENGTH} "
                         "characters (lowercase letters, digits and '-', starting with a letter)")
    return pool
