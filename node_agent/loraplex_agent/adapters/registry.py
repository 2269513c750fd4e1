"""The agent's adapters by name, in one map: each one's weights in host memory, its folder (peers fetch
it from there) and where it stands. It is also the engine core's table of the adapters it serves
(`loraplex.engine.adapter_table`), and the executor reads an adapter's weights from it, so nothing
else keeps a map of them to be kept in step.

An adapter goes through four states:
- held: its weights are in host memory, not yet in the engine (`hold`; the core refused it: `release`);
- servable: in the engine and open to new requests (the core `admit`s it);
- unloading: in the engine while its accepted requests finish, closed to new ones (`begin_unload`);
- held again once the core `retire`s it, until `release` drops its weights.
A name in any state is taken: loading it again is a conflict until it is released.

The engine thread changes it and the event loop reads it, under one lock. As a Mapping it is the
servable adapters (what `/v1/models`, the router's requests and peers see)."""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum

from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import ConflictError, NotFoundError
from loraplex_agent.adapters.host import HostAdapter


@dataclass(frozen=True)
class AdapterRecord:
    host: HostAdapter
    path: str | None = None  # the folder it was read from (None: made in memory)

    @property
    def info(self) -> AdapterInfo:
        return self.host.info


class State(Enum):
    HELD = "held"
    SERVABLE = "servable"
    UNLOADING = "unloading"


@dataclass
class _Entry:
    record: AdapterRecord
    state: State


class AdapterRegistry(Mapping[str, AdapterRecord]):
    """As a Mapping: the servable adapters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    # ---- the servable ones (the event loop's view) ------------------------------------------

    def __getitem__(self, name: str) -> AdapterRecord:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state is not State.SERVABLE:
                raise KeyError(name)
            return entry.record

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter([name for name, entry in self._entries.items() if entry.state is State.SERVABLE])

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.state is State.SERVABLE)

    def items(self) -> ItemsView[str, AdapterRecord]:
        """A copy taken at once (the engine thread may unload one meanwhile)."""
        with self._lock:
            return {name: entry.record for name, entry in self._entries.items()
                    if entry.state is State.SERVABLE}.items()

    # ---- weights --------------------------------------------------------------------------

    def host(self, adapter_id: AdapterId) -> HostAdapter:
        """The weights of `adapter_id`, in whatever state (what the executor copies to the device)."""
        with self._lock:
            entry = self._entries.get(adapter_id.name)
            if entry is None or entry.record.info.id != adapter_id:
                raise NotFoundError(f"adapter {adapter_id} is not in host memory")
            return entry.record.host

    def holds(self, adapter_id: AdapterId) -> bool:
        with self._lock:
            entry = self._entries.get(adapter_id.name)
            return entry is not None and entry.record.info.id == adapter_id

    # ---- changes --------------------------------------------------------------------------

    def check_free(self, name: str) -> None:
        """ConflictError when `name` is taken (held, servable or still being unloaded)."""
        with self._lock:
            self._check_free(name)

    def hold(self, record: AdapterRecord) -> None:
        """Its weights are in host memory, on their way into the engine; refuses a taken name."""
        with self._lock:
            self._check_free(record.info.id.name)
            self._entries[record.info.id.name] = _Entry(record, State.HELD)

    def _check_free(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        if entry.state is State.UNLOADING:
            raise ConflictError(f"adapter {name!r} is still being unloaded (requests are running on it); "
                                "try again when they finish", param="lora_name")
        if entry.state is State.SERVABLE:
            raise ConflictError(f"adapter {name!r} is already loaded; unload it first", param="lora_name")
        raise ConflictError(f"adapter {name!r} is being loaded", param="lora_name")

    def release(self, adapter_id: AdapterId) -> None:
        """Drop the weights of a held adapter (never one in the engine)."""
        with self._lock:
            entry = self._entries.get(adapter_id.name)
            if entry is None or entry.record.info.id != adapter_id:
                raise NotFoundError(f"adapter {adapter_id} is not in host memory")
            if entry.state is not State.HELD:
                raise ConflictError(f"adapter {adapter_id.name!r} is in the engine; retire it first")
            del self._entries[adapter_id.name]

    def begin_unload(self, name: str) -> AdapterInfo:
        """No longer servable; the engine retires it once its accepted requests have finished."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state is not State.SERVABLE:
                raise NotFoundError(f"adapter {name!r} is not loaded", param="lora_name")
            entry.state = State.UNLOADING
            return entry.record.info

    def unloading(self) -> dict[str, AdapterInfo]:
        with self._lock:
            return {name: entry.record.info for name, entry in self._entries.items()
                    if entry.state is State.UNLOADING}

    # ---- the engine core's table (loraplex.engine.adapter_table.AdapterTable) ---------------

    def serving(self, name: str) -> AdapterInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None or entry.state is State.HELD else entry.record.info

    def admit(self, info: AdapterInfo) -> None:
        with self._lock:
            entry = self._entries.get(info.id.name)
            if entry is None or entry.record.info.id != info.id or entry.state is not State.HELD:
                raise NotFoundError(f"adapter {info.id} is not held in host memory; hold it before the engine "
                                    "admits it")
            entry.state = State.SERVABLE

    def retire(self, name: str) -> AdapterInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state is State.HELD:
                return None
            entry.state = State.HELD
            return entry.record.info
