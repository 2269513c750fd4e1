"""Every subcommand refuses a bad port, a bad number, a bad choice and a missing input file the same
way: exit status 2 and one line on stderr that names the flag, before anything starts."""

from __future__ import annotations

import argparse

import pytest

from loraplex.cli import build_registry, main
from loraplex.util.args import existing_dir, existing_file, port

REGISTRY = build_registry()


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, (*path, name))


COMMANDS = dict(_leaves(REGISTRY.parser))


def _cases(kind: str):
    for path, parser in COMMANDS.items():
        for action in parser._actions:
            if not action.option_strings and kind != "path":
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            name = getattr(action.type, "__name__", "")
            if kind == "port" and action.type is port:
                yield pytest.param(path, action, ["-5", "0", "99999"], id=f"port: {' '.join(path)} {flag}")
            elif kind == "number" and name.startswith("non-negative"):
                yield pytest.param(path, action, ["-3", "nan", "x"], id=f"number: {' '.join(path)} {flag}")
            elif kind == "choice" and action.choices and not isinstance(action, argparse._SubParsersAction):
                yield pytest.param(path, action, ["bogus"], id=f"choice: {' '.join(path)} {flag}")
            elif kind == "path" and action.type in (existing_file, existing_dir):
                yield pytest.param(path, action, ["/nonexistent/x.yaml"], id=f"path: {' '.join(path)} {flag}")


def _refused(capsys, path, action, value: str) -> None:
    argv = [*path, f"{action.option_strings[-1]}={value}"] if action.option_strings else [*path, value]
    with pytest.raises(SystemExit) as exit_:  # main() returns this status (test_help_... runs main itself)
        REGISTRY.parser.parse_args(argv)
    assert exit_.value.code == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    named = "/".join(action.option_strings) or action.dest
    assert err[0].startswith("error: ") and f"argument {named}" in err[0], err[0]
    assert "Traceback" not in err[0]


KINDS = ("port", "number", "choice", "path")  # ports 1-65535; non-negative finite numbers; choices; input files


@pytest.mark.parametrize(("path", "action", "values"), [case for kind in KINDS for case in _cases(kind)])
def test_a_bad_value_is_refused_in_one_line_naming_the_flag(capsys, path, action, values):
    for value in values:
        _refused(capsys, path, action, value)


def test_every_numeric_flag_is_checked():
    """No subcommand keeps a bare int/float flag (check_values wraps them all)."""
    bare = [f"{' '.join(path)} {a.option_strings}" for path, parser in COMMANDS.items()
            for a in parser._actions if a.type in (int, float)]
    assert not bare


def test_the_classes_cover_every_server_command():
    covered = {case.values[0] for kind in KINDS for case in _cases(kind)}
    for command in [("agent",), ("router",), ("up",), ("operator",), ("sim", "plan"), ("workload", "generate")]:
        assert command in covered


def test_help_lists_every_command_on_one_line_each(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("commands:\n", 1)[1].splitlines()
    assert len(listed) == len(COMMANDS)
    for path in COMMANDS:
        assert sum(line.split("  ")[1].strip() == " ".join(path) for line in listed if line.strip()) == 1, path


def test_a_malformed_input_file_is_one_line_too(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload:\n  rps: [1\n")
    assert main(["workload", "generate", "--spec", str(bad), "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --spec {bad}: ") and "line 3" in err[0], err
    assert main(["workload", "generate", "--rps", "1", "--out", str(tmp_path / "no" / "t.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'no' / 't.jsonl'}: No such file or directory"]
