"""Condition lists as Kubernetes wants them: one entry per type, and `lastTransitionTime` moves only
when the status of that type changes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

from loraplex.spec.crd import Condition


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(previous: Sequence[Condition], type_: str, ok: bool, reason: str, message: str, now: float,
                  generation: int | None = None) -> Condition:
    """The new condition of `type_`, keeping the old transition time when the status did not change."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    return Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since,
                     observed_generation=generation)
