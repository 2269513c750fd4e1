"""The shared fixtures work: the tiny model loads in transformers and redis answers."""

from __future__ import annotations

import json

import redis


def test_tiny_model_layout(tiny_model) -> None:
    config = json.loads((tiny_model.base_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tiny_model.base_dir / "model.safetensors").exists()
    assert list(tiny_model.adapter_ranks().values()) == [8, 16, 32, 64, 8, 16, 32, 64]
    for path in tiny_model.adapters.values():
        assert (path / "adapter_model.safetensors").exists()


def test_redis_fixture(redis_url: str, free_port) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert free_port() > 0
