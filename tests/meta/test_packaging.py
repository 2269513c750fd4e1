"""The `all` extra installs every component: it is the union of the component extras."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
NOT_COMPONENTS = {"all", "dev"}


def expand(extra: str) -> tuple[set[str], set[str]]:
    """(extras reached, requirements) of one extra, following `loraplex[...]` self-references."""
    reached, requirements, todo = set(), set(), [extra]
    while todo:
        name = todo.pop()
        reached.add(name)
        for line in EXTRAS[name]:
            requirement = Requirement(line)
            if requirement.name == PROJECT["name"]:
                todo.extend(sorted(requirement.extras - reached))
            else:
                requirements.add(str(requirement))
    return reached - {extra}, requirements


def test_all_is_the_union_of_the_component_extras():
    components = set(EXTRAS) - NOT_COMPONENTS
    reached, requirements = expand("all")
    assert reached == components
    assert requirements == {str(Requirement(line)) for c in components for line in EXTRAS[c]}


def test_every_component_command_has_an_extra_in_all():
    commands = set(PROJECT["entry-points"]["loraplex.commands"])
    assert commands <= expand("all")[0]


def test_the_cel_interpreter_and_the_ext_proc_stubs_live_together():
    """xds-protos writes a cel/__init__.py of its own (for cel.expr); installed after the CEL
    interpreter it hides it (scripts/setup.sh reinstalls the interpreter last)."""
    import cel
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert hasattr(cel, "evaluate"), "cel/__init__.py is xds-protos': reinstall common-expression-language"
    assert external_processor_pb2.ProcessingRequest.DESCRIPTOR.full_name == "envoy.service.ext_proc.v3.ProcessingRequest"
