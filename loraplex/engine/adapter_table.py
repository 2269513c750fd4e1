"""The adapters an engine serves, by name. `EngineCore` checks every request's adapter here and
admits and retires adapters through it, and keeps no name map of its own: an owner that holds more
per adapter (the node agent's registry: host weights, folder, unloading) passes itself in, so the
engine's adapters are one map."""

from __future__ import annotations

from typing import Protocol

from loraplex.spec.adapter import AdapterInfo


class AdapterTable(Protocol):
    def serving(self, name: str) -> AdapterInfo | None:
        """The adapter `name` while it is in the engine (admitted, not yet retired)."""

    def admit(self, info: AdapterInfo) -> None:
        """`info` is in the engine from now on; the core has checked that its name is not."""

    def retire(self, name: str) -> AdapterInfo | None:
        """`name` is out of the engine; None when it was not in it."""


class AdapterInfos(dict[str, AdapterInfo]):
    """The table of an engine whose owner keeps nothing more per adapter (the twin, benchmarks)."""

    def serving(self, name: str) -> AdapterInfo | None:
        return self.get(name)

    def admit(self, info: AdapterInfo) -> None:
        self[info.id.name] = info

    def retire(self, name: str) -> AdapterInfo | None:
        return self.pop(name, None)
