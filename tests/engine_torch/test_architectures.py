"""Model-level equality with HF transformers for the Llama-family variants: Qwen2 (q/k/v bias),
tied embeddings, llama3 and linear rope scaling, Mistral, and a sharded checkpoint."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from loraplex_agent.runtime.llm import LLM
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from loraplex.engine.output.sampling import SamplingParams

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
VARIANTS = {
    "qwen2-bias": lambda: Qwen2Config(**SHAPE),
    "llama-tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "llama3-rope": lambda: LlamaConfig(**SHAPE, rope_theta=50000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "linear-rope": lambda: LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=128),
    "sharded": lambda: LlamaConfig(**SHAPE),
}


def save_random_model(config, out, tokenizer_dir, shard: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():  # HF zero-initialises biases; make every weight matter
            param.normal_(0.0, 0.1)
    model.save_pretrained(out, max_shard_size="100KB" if shard else "1GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return model


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_logits_match_hf(variant, tmp_path, tiny_model):
    hf = save_random_model(VARIANTS[variant](), tmp_path, tiny_model.base_dir, shard=variant == "sharded")
    if variant == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(tmp_path, dtype="float32", device="cpu", num_blocks=32, max_num_batched_tokens=24)
    llm.executor.capture_logits = True
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 9)]
    requests = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for request in requests:
        tokens = request.prompt_token_ids + request.output_token_ids
        with torch.inference_mode():
            expected = hf(input_ids=torch.tensor([tokens])).logits[0, request.num_prompt_tokens - 1:-1]
        ours = torch.stack(llm.executor.captured_logits[request.request_id])
        assert (ours - expected).abs().max().item() <= 1e-4
        assert expected.argmax(-1).tolist() == request.output_token_ids
