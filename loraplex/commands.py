"""Subcommands that live in the torch-free core (simulator, workloads, load generator)."""

from __future__ import annotations

from types import ModuleType

from loraplex.cli import CommandRegistry


def register(registry: CommandRegistry) -> None:
    """Core commands are added here as the core grows; each imports its module lazily."""
    registry.add("bench placement", "time the placement policies on a synthetic pool",
                 lambda parser: _bench_placement().configure(parser), lambda args: _bench_placement().run(args))


def _bench_placement() -> ModuleType:
    from loraplex.placement import bench

    return bench
