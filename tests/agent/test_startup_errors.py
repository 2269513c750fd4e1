"""`loraplex agent` refuses a bad start with one line on stderr and a non-zero exit, never a
traceback or uvicorn's "Application startup failed"; without --max-lora-rank the engine is sized
from the start-up adapters."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loraplex_agent.api.server import load_engine, parse_adapters

from loraplex.cli import build_registry

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def start_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LORAPLEX, "agent", "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in result.stderr and "startup failed" not in result.stderr


def test_a_model_folder_without_a_config_is_one_line(tmp_path, free_port):
    result = start_agent("--model", str(tmp_path), "--port", str(free_port()))
    assert_one_line_error(result, "config.json")


def test_a_model_folder_without_a_tokenizer_is_one_line(tiny_model, tmp_path, free_port):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model.base_dir) / name, tmp_path / name)
    result = start_agent("--model", str(tmp_path), "--port", str(free_port()))
    assert_one_line_error(result, "cannot load the model from", "tokenizer")


def test_a_bad_adapter_folder_is_one_line(tiny_model, free_port):
    result = start_agent("--model", str(tiny_model.base_dir), "--port", str(free_port()),
                         "--adapter", f"bad={tiny_model.base_dir}")  # a model, not a PEFT adapter
    assert_one_line_error(result, "--adapter bad=", "adapter_config.json")


def test_an_adapter_above_max_lora_rank_is_one_line(tiny_model, free_port):
    result = start_agent("--model", str(tiny_model.base_dir), "--port", str(free_port()),
                         "--adapter", f"big={tiny_model.adapters['lora03-r64']}", "--max-lora-rank", "16")
    assert_one_line_error(result, "--adapter big=", "rank 64", "--max-lora-rank")


def test_a_port_in_use_is_one_line(tiny_model, port_in_use):
    result = start_agent("--model", str(tiny_model.base_dir), "--port", str(port_in_use))
    assert_one_line_error(result, f"127.0.0.1:{port_in_use}", "in use")


def test_unreachable_redis_is_one_line(tiny_model, free_port):
    result = start_agent("--model", str(tiny_model.base_dir), "--port", str(free_port()),
                         "--redis-url", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert_one_line_error(result, "cannot reach Redis")


@pytest.mark.parametrize(("adapters", "flag", "rank"), [
    (("lora00-r8", "lora01-r16"), [], 64),  # a runtime load up to rank 64 works with the defaults
    ((), [], 64),
    (("lora00-r8",), ["--max-lora-rank", "32"], 32),
])
def test_max_lora_rank_defaults_to_64_or_the_largest_start_up_adapter(tiny_model, adapters, flag, rank):
    specs = [arg for name in adapters for arg in ("--adapter", f"{name}={tiny_model.adapters[name]}")]
    argv = ["agent", "--model", str(tiny_model.base_dir), "--device", "cpu", "--num-blocks", "64",
            "--max-model-len", "256", *specs, *flag]
    args = build_registry().parser.parse_args(argv)
    engine = load_engine(args, parse_adapters(args.adapter))
    assert engine.core.config.max_lora_rank == rank
    assert sorted(engine.adapters) == sorted(adapters)
