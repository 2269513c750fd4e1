"""The one `loraplex` command. Components add subcommands through the `loraplex.commands`
entry-point group, so the core never imports them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points, version
from typing import NoReturn

from loraplex.spec.errors import CommandError, one_line
from loraplex.util.args import RefusingParser, check_values

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]
Check = Callable[[argparse.Namespace], object]  # raises CommandError for values the command would refuse


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`error: argument --port: ...`), no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the flags)\n")


@dataclass
class _Group:
    parser: argparse.ArgumentParser
    subparsers: argparse._SubParsersAction
    children: dict[str, _Group] = field(default_factory=dict)


COMMAND_ORDER = ("up", "agent", "router", "operator", "crds", "make-tiny-model", "workload", "sim", "profile", "bench")
GROUP_HELP = {
    "bench": "benchmarks: the engine, router, placement, schedulers, memory policies, reliability",
    "sim": "the digital twin: replay a trace, plan the fewest GPUs",
    "workload": "generate a workload trace, or describe one",
    "crds": "the CustomResourceDefinitions",
}


class CommandRegistry:
    """Builds nested argparse subcommands from paths such as "bench engine"."""

    def __init__(self, prog: str = "loraplex") -> None:
        parser = Parser(prog=prog, usage=f"{prog} [-h] COMMAND ...", description="Serve many LoRA adapters of one base LLM.",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
        # The root lists every command, one line each (summary()), instead of argparse's groups.
        self._root = _Group(parser, parser.add_subparsers(dest="command", metavar="COMMAND", prog=prog,
                                                              help=argparse.SUPPRESS))
        self._commands: list[tuple[str, str]] = []
        self._configures: dict[str, Configure] = {}
        self._checks: dict[str, Check] = {}

    @property
    def parser(self) -> argparse.ArgumentParser:
        return self._root.parser

    def add(self, path: str, help: str, configure: Configure, run: Run, check: Check | None = None) -> None:
        """`check`, when given, refuses values the parser takes (check_args runs it too)."""
        *groups, leaf = path.split()
        group = self._root
        for name in groups:
            group = self._group(group, name)
        sub = group.subparsers.add_parser(leaf, help=help, description=help)
        self._commands.append((path, help))
        self._configures[path] = configure
        if check is not None:
            self._checks[path] = check
        configure(sub)
        check_values(sub)
        sub.set_defaults(_run=run)

    def check_args(self, path: str, argv: Sequence[str]) -> argparse.Namespace:
        """`argv` parsed as `loraplex <path>` parses it, without running the command: CommandError (one
        line naming the flag) for what it would refuse: its parser, then its `check`. Its required flags
        are not required here: the caller checking them (`loraplex up` for --agent-arg) passes those itself.
        No abbreviations and no -h: `--por=9000` must not slip past the flags a caller owns."""
        parser = RefusingParser(prog=f"loraplex {path}")
        self._configures[path](parser)
        check_values(parser)
        for action in parser._actions:
            action.required = False
        try:
            args = parser.parse_args(argv)
        except ValueError as exc:
            raise CommandError(f"{path} arguments: {exc}") from None
        if path in self._checks:
            self._checks[path](args)
        return args

    def help_parser(self, command: str | None) -> argparse.ArgumentParser:
        group = self._root.children.get(command or "")
        return group.parser if group else self.parser

    def summary(self) -> str:
        """Every command with one line of help: the ones a new user starts with first, benchmarks last."""
        order = [*COMMAND_ORDER, *dict.fromkeys(path.split()[0] for path, _ in self._commands)]
        rows = sorted(self._commands, key=lambda c: order.index(c[0].split()[0]))
        width = max(len(path) for path, _ in rows) + 2
        return "commands:\n" + "\n".join(f"  {path:<{width}}{_help_line(text)}" for path, text in rows)

    def _group(self, parent: _Group, name: str) -> _Group:
        if name not in parent.children:
            text = GROUP_HELP.get(name, f"{name} commands")
            parser = parent.subparsers.add_parser(name, help=text, description=text)
            parent.children[name] = _Group(parser, parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND"))
        return parent.children[name]


def run_module(module: str, function: str = "run") -> Run:
    """A command's run (or check) that imports `module` (and what it needs: torch, kopf...) only when
    it is called."""

    def run(args: argparse.Namespace) -> int:
        return getattr(import_module(module), function)(args)

    return run


def _help_line(text: str, width: int = 72) -> str:
    """The help's first clause when it says enough, cut to `width` characters."""
    for sep in (": ", "; ", " ("):
        head = text.split(sep)[0]
        if len(head) >= 28:
            text = head
    text = text[0].upper() + text[1:]
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " …"


def build_registry(only: str | None = None) -> CommandRegistry:
    """Every command; with `only`, the core's and those of the component registered under that name
    (`loraplex up` checking --agent-arg loads the agent's, not the 12 benchmark modules)."""
    registry = CommandRegistry()
    from loraplex import commands

    commands.register(registry)
    for entry in sorted(entry_points(group="loraplex.commands"), key=lambda e: e.name):
        if only is not None and entry.name != only:
            continue
        try:
            register = entry.load()
        except ImportError as exc:  # the component's extra is not installed
            _register_unavailable(registry, entry.name, exc)
            continue
        register(registry)
    registry.parser.epilog = registry.summary()
    return registry


def _register_unavailable(registry: CommandRegistry, name: str, exc: ImportError) -> None:
    def run(_: argparse.Namespace) -> int:
        raise CommandError(f"the '{name}' component is not installed ({exc}); install it with scripts/setup.sh, "
                           f"or pip install '.[{name}]' in a checkout (Loraplex is not on PyPI)")

    registry.add(name, f"(unavailable: {exc.name} is missing)", lambda p: None, run)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:
        print(f"loraplex {version('loraplex')}")
        return 0
    registry = build_registry(_component(argv))
    try:
        args = registry.parser.parse_args(argv)
    except SystemExit as exc:  # --help (0), or a refused flag: its one line is printed already
        return exc.code if isinstance(exc.code, int) else 2
    run = getattr(args, "_run", None)
    if run is None:  # `loraplex` or a group such as `loraplex sim`: its commands
        registry.help_parser(args.command).print_help()
        return 2
    try:
        return int(run(args) or 0)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a file or folder the command needed
        if os.environ.get("LORAPLEX_DEBUG"):
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: still one line; LORAPLEX_DEBUG=1 shows the traceback
        if os.environ.get("LORAPLEX_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {one_line(exc)} (LORAPLEX_DEBUG=1 shows where)", file=sys.stderr)
        return 1


def _component(argv: Sequence[str]) -> str | None:
    """The entry point a command line needs alone: its first word when a component registers under that
    name and no help of the whole command is asked; else None (all of them)."""
    names = {entry.name for entry in entry_points(group="loraplex.commands")}
    return argv[0] if argv and argv[0] in names else None


if __name__ == "__main__":
    sys.exit(main())
