"""Helpers for adapter tests: a writable copy of a tiny-model adapter and editors for its files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from loraplex_agent.runtime.model.config import ModelConfig
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="session")
def model_config(tiny_model) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model.base_dir)


@pytest.fixture
def copy_adapter(tiny_model, tmp_path: Path) -> Callable[[str], Path]:
    """copy_adapter("lora01-r16") -> a writable copy of that adapter folder."""
    def copy(name: str = "lora01-r16") -> Path:
        target = tmp_path / f"copy-{name}"
        shutil.copytree(tiny_model.adapters[name], target)
        return target
    return copy


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, change: Callable[[dict], dict]) -> None:
    path = folder / "adapter_model.safetensors"
    save_file(change(load_file(path)), path)


@pytest.fixture
def config_editor() -> Callable[..., None]:
    return edit_config


@pytest.fixture
def weights_editor() -> Callable[[Path, Callable[[dict], dict]], None]:
    return edit_weights
