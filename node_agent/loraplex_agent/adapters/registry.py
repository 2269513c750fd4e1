"""The agent's adapters by name, in one place: which are servable (the event loop's view, what the
cluster's view of the engine reads as `adapters`), which are being unloaded (their accepted requests
still run), and each one's folder (peers fetch it from there). The engine thread and the event loop
both change it, under one lock, so no two maps are kept in step by hand.

The engine core's own map (loraplex.engine.core: what it schedules) and the host copies by id
(adapters.AdapterStore: several versions of one name while old requests finish) stay the engine's;
only AsyncEngine's engine thread changes them, in the order this registry says."""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, Mapping
from dataclasses import dataclass

from loraplex.spec.adapter import AdapterInfo
from loraplex.spec.errors import ConflictError, NotFoundError


@dataclass(frozen=True)
class AdapterRecord:
    info: AdapterInfo
    path: str


class AdapterRegistry(Mapping[str, AdapterRecord]):
    """As a Mapping: the servable adapters (loaded and not being unloaded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servable: dict[str, AdapterRecord] = {}
        self._unloading: dict[str, AdapterRecord] = {}

    def __getitem__(self, name: str) -> AdapterRecord:
        with self._lock:
            return self._servable[name]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._servable))

    def __len__(self) -> int:
        with self._lock:
            return len(self._servable)

    def items(self) -> ItemsView[str, AdapterRecord]:
        """A copy taken at once (the engine thread may unload one meanwhile)."""
        with self._lock:
            return dict(self._servable).items()

    def check_free(self, name: str) -> None:
        """ConflictError when `name` is loaded, or still being unloaded."""
        with self._lock:
            self._check_free(name)

    def add(self, record: AdapterRecord) -> None:
        """Refuses a name that is not free (`check_free`)."""
        with self._lock:
            self._check_free(record.info.id.name)
            self._servable[record.info.id.name] = record

    def _check_free(self, name: str) -> None:
        if name in self._unloading:
            raise ConflictError(f"adapter {name!r} is still being unloaded (requests are running on it); "
                                "try again when they finish", param="lora_name")
        if name in self._servable:
            raise ConflictError(f"adapter {name!r} is already loaded; unload it first", param="lora_name")

    def begin_unload(self, name: str) -> AdapterInfo:
        """No longer servable; `forget` it once its accepted requests have finished."""
        with self._lock:
            record = self._servable.pop(name, None)
            if record is None:
                raise NotFoundError(f"adapter {name!r} is not loaded", param="lora_name")
            self._unloading[name] = record
            return record.info

    def unloading(self) -> dict[str, AdapterInfo]:
        with self._lock:
            return {name: record.info for name, record in self._unloading.items()}

    def forget(self, name: str) -> None:
        """Gone: unloaded, or its registration failed."""
        with self._lock:
            self._servable.pop(name, None)
            self._unloading.pop(name, None)
