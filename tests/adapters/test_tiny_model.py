"""make-tiny-model: deterministic, loadable by transformers+peft, and every adapter changes the output."""

from __future__ import annotations

import argparse

import pytest
import torch
from loraplex_agent.tools.tiny_model import make_tiny_model, parse_ranks, run

from loraplex.spec.errors import CommandError


def test_same_seed_same_bytes(tiny_model, tmp_path) -> None:
    again = make_tiny_model(tmp_path, num_adapters=2, ranks=(8, 16), seed=0)
    for relative in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again.base_dir / relative).read_bytes() == (tiny_model.base_dir / relative).read_bytes()
    for name in again.adapters:
        weights = "adapter_model.safetensors"
        assert (again.adapters[name] / weights).read_bytes() == (tiny_model.adapters[name] / weights).read_bytes()


def test_tokenizer_and_chat_template(tiny_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.base_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("def main():\n    return 0").input_ids
    assert ids[0] == 0 and tokenizer.decode(ids, skip_special_tokens=True) == "def main():\n    return 0"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_every_adapter_changes_greedy_output(tiny_model) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model.base_dir, dtype=torch.float32)
    names = list(tiny_model.adapters)
    model = PeftModel.from_pretrained(base, str(tiny_model.adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(tiny_model.adapters[name]), adapter_name=name)
    input_ids = torch.tensor([[0, 400, 500, 600, 700]] * (len(names) + 1))
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=6, pad_token_id=0, adapter_names=["__base__", *names])
    continuations = {tuple(row[5:].tolist()) for row in out}
    assert len(continuations) == len(names) + 1


def test_command_arguments(tmp_path, capsys) -> None:
    assert parse_ranks("8, 16") == [8, 16]
    for bad in ("8,x", "", "0"):
        with pytest.raises(CommandError, match="--ranks"):
            parse_ranks(bad)
    args = argparse.Namespace(out=str(tmp_path), adapters=1, ranks="4", seed=1, hidden_size=64, layers=1,
                              vocab_size=400, alora_adapters=1)
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "adapter lora00-r4: rank 4" in out and "adapter alora00-r4: rank 4" in out
    with pytest.raises(CommandError, match="hidden size"):
        run(argparse.Namespace(**{**vars(args), "hidden_size": 30}))
