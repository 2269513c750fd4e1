"""Device, dtype and KV sizing; the LLM's adapter handling; checkpoint refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from loraplex_agent.runtime.device import kv_block_bytes, num_kv_blocks, resolve_device, resolve_dtype
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.runtime.model.config import ModelConfig

from loraplex.engine.output.sampling import SamplingParams
from loraplex.spec.errors import InvalidRequestError, NotFoundError

CPU = torch.device("cpu")


def test_dtype_and_device_resolution(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    assert resolve_device("cpu") == CPU
    assert resolve_dtype("auto", config, CPU) == torch.float32
    assert resolve_dtype("bfloat16", config, CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", config, CPU)
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("mps")


def test_kv_blocks_from_flags_memory_and_cap(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    per_block = kv_block_bytes(config, 16, torch.float32)
    assert per_block == 2 * 4 * 2 * 64 * 16 * 4
    sizing = dict(block_size=16, max_model_len=2048, max_num_seqs=256)
    assert num_kv_blocks(config, CPU, torch.float32, num_blocks=7, **sizing) == 7
    assert num_kv_blocks(config, CPU, torch.float32, kv_cache_memory_gib=0.125, **sizing) == (1 << 27) // per_block
    assert num_kv_blocks(config, CPU, torch.float32, **sizing) == (1 << 30) // per_block  # 1 GiB default
    small = dict(block_size=16, max_model_len=128, max_num_seqs=4)
    assert num_kv_blocks(config, CPU, torch.float32, **small) == 8 * 4 + 1  # capped at what 4 requests use


def test_llm_adapters_and_errors(tiny_model):
    llm = LLM(tiny_model.base_dir, device="cpu", max_model_len=64, num_blocks=64)
    info = llm.add_adapter("lora01-r16", tiny_model.adapters["lora01-r16"])
    assert info.rank == 16 and llm.adapters["lora01-r16"].info == info
    with pytest.raises(NotFoundError):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=["nope"])
    [request] = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=3), ["lora01-r16"])
    assert request.prompt_token_ids[0] == llm.tokenizer.bos_token_id and len(request.output_token_ids) >= 1
    assert llm.remove_adapter("lora01-r16").id == info.id
    assert "lora01-r16" not in llm.adapters and not llm.adapters.holds(info.id)
    with pytest.raises(InvalidRequestError, match="exceeds"):
        LLM(tiny_model.base_dir, device="cpu", max_model_len=10**6)


def test_checkpoint_without_safetensors_is_refused(tiny_model, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model.base_dir / name, tmp_path / name)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(InvalidRequestError, match="only safetensors"):
        LLM(tmp_path, device="cpu", max_model_len=64, num_blocks=16)
