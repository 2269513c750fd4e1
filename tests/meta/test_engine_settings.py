"""Each engine setting is declared once (loraplex.spec.engine_settings): the CRD model, the engine's
defaults, the registries of policies, the docs' table and the engine's flags (with their bounds)
agree with the declaration."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
from loraplex_agent.cli import add_engine_args

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.policies import MEMORY_POLICIES
from loraplex.engine.scheduling.schedulers import SCHEDULERS
from loraplex.spec.crd import EngineSpec
from loraplex.spec.engine_settings import AGENT_SETTINGS, ENGINE_SETTINGS, settings_table

ROOT = Path(__file__).resolve().parents[2]
DOCS_TABLE = re.compile(r"<!-- engine-settings:[^>]*-->\n(.*?)\n<!-- /engine-settings -->", re.S)


def test_the_docs_table_is_the_declarations():
    found = DOCS_TABLE.search((ROOT / "docs" / "engine.md").read_text())
    assert found, "docs/engine.md lost its engine-settings table"
    assert found.group(1) == settings_table(), "regenerate it from loraplex.spec.engine_settings.settings_table()"


@pytest.mark.parametrize("name", ENGINE_SETTINGS)
def test_the_crd_field_is_the_declaration(name):
    setting, field = ENGINE_SETTINGS[name], EngineSpec.model_fields[name]
    assert field.default == setting.default
    assert setting.type in typing.get_args(field.annotation) or field.annotation is setting.type


@pytest.mark.parametrize("name", sorted(set(ENGINE_SETTINGS) & {f for f in EngineConfig.__dataclass_fields__}
                                        - {"max_model_len"}))  # the engine's own: the model's limit is read later
def test_the_engines_default_is_the_declaration(name):
    assert EngineConfig.__dataclass_fields__[name].default == ENGINE_SETTINGS[name].default


def test_the_flags_offer_every_registered_policy():
    assert set(ENGINE_SETTINGS["scheduler"].choices) == set(SCHEDULERS)
    assert set(ENGINE_SETTINGS["memory_policy"].choices) == set(MEMORY_POLICIES)


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    return parser


def test_every_engine_flag_is_declared_once():
    """The flags `loraplex agent`, `loraplex profile` and the benchmarks share are the declarations:
    the pool's settings and the engine's own, none declared anywhere else, none in both."""
    flags = {a.dest: a for a in _engine_parser()._actions if a.dest != "help"}
    assert not set(ENGINE_SETTINGS) & set(AGENT_SETTINGS)
    assert set(flags) == {s.dest for s in (*ENGINE_SETTINGS.values(), *AGENT_SETTINGS.values())}
    for setting in AGENT_SETTINGS.values():
        action = flags[setting.dest]
        assert (action.option_strings, action.help) == ([setting.flag], setting.help)
        assert action.default == (list(setting.default) if setting.action == "append" else setting.default)


@pytest.mark.parametrize("argv", [["--num-blocks", "0"], ["--num-host-blocks", "-1"], ["--threads", "0"],
                                  ["--emulate-h2d-gbps", "0"], ["--emulate-h2d-gbps", "inf"], ["--cpu-assist", "yes"]])
def test_an_engine_flag_refuses_what_its_declaration_bounds(argv):
    with pytest.raises(argparse.ArgumentError):
        _engine_parser().parse_args(argv)


def test_repeatable_flags_do_not_share_their_defaults():
    first, second = _engine_parser().parse_args([]), _engine_parser().parse_args(["--memory-option", "busy=0.9"])
    assert (first.memory_option, second.memory_option, first.scheduler_option) == ([], ["busy=0.9"], [])
