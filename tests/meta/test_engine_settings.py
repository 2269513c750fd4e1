"""Each engine setting is declared once (loraplex.spec.engine_settings): the CRD model, the engine's
defaults, the registries of policies and the docs' table agree with the declaration."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.policies import MEMORY_POLICIES
from loraplex.engine.scheduling.schedulers import SCHEDULERS
from loraplex.spec.crd import EngineSpec
from loraplex.spec.engine_settings import ENGINE_SETTINGS, settings_table

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
