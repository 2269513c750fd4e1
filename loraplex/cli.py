"""The one `loraplex` command. Components add subcommands through the `loraplex.commands`
entry-point group, so the core never imports them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points

from loraplex.spec.errors import CommandError

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


@dataclass
class _Group:
    parser: argparse.ArgumentParser
    subparsers: argparse._SubParsersAction
    children: dict[str, _Group] = field(default_factory=dict)


class CommandRegistry:
    """Builds nested argparse subcommands from paths such as "bench engine"."""

    def __init__(self, prog: str = "loraplex") -> None:
        parser = argparse.ArgumentParser(prog=prog, description="Serve many LoRA adapters of one base LLM.")
        self._root = _Group(parser, parser.add_subparsers(dest="command", metavar="COMMAND"))

    @property
    def parser(self) -> argparse.ArgumentParser:
        return self._root.parser

    def add(self, path: str, help: str, configure: Configure, run: Run) -> None:
        *groups, leaf = path.split()
        group = self._root
        for name in groups:
            group = self._group(group, name)
        sub = group.subparsers.add_parser(leaf, help=help, description=help)
        configure(sub)
        sub.set_defaults(_run=run)

    def _group(self, parent: _Group, name: str) -> _Group:
        if name not in parent.children:
            parser = parent.subparsers.add_parser(name, help=f"{name} commands")
            parent.children[name] = _Group(parser, parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND"))
        return parent.children[name]


def run_module(module: str) -> Run:
    """A command's run that imports `module` (and what it needs: torch, kopf...) only when it runs."""

    def run(args: argparse.Namespace) -> int:
        return import_module(module).run(args)

    return run


def build_registry() -> CommandRegistry:
    registry = CommandRegistry()
    from loraplex import commands

    commands.register(registry)
    for entry in sorted(entry_points(group="loraplex.commands"), key=lambda e: e.name):
        try:
            register = entry.load()
        except ImportError as exc:  # the component's extra is not installed
            _register_unavailable(registry, entry.name, exc)
            continue
        register(registry)
    return registry


def _register_unavailable(registry: CommandRegistry, name: str, exc: ImportError) -> None:
    def run(_: argparse.Namespace) -> int:
        raise CommandError(f"the '{name}' component is not installed ({exc}); install loraplex[{name}]")

    registry.add(name, f"(unavailable: {exc.name} is missing)", lambda p: None, run)


def main(argv: Sequence[str] | None = None) -> int:
    registry = build_registry()
    args = registry.parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        registry.parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
