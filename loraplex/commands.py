"""Subcommands that live in the torch-free core (simulator, workloads, load generator)."""

from __future__ import annotations

from loraplex.cli import CommandRegistry


def register(registry: CommandRegistry) -> None:
    """Core commands are added here as the core grows; each imports its module lazily."""
