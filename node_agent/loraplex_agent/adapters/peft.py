"""PEFT LoRA folders read into host memory and validated against the base model.

A folder holds `adapter_config.json` and `adapter_model.safetensors`. Loading refuses, with the
reason, anything the engine would not compute exactly as PEFT does (DoRA, biases, extra trainable
modules, layer subsets, ...), weights that do not fit the base model, and pickle weights. The
rules are listed in docs/adapters.md.

An adapter's identity is its name plus the sha256 of its weights file, so the same name uploaded
again with other weights is a different `AdapterId`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from loraplex.spec.adapter import AdapterId, AdapterInfo, validate_adapter_name
from loraplex.spec.errors import AdapterError
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.runtime.model.config import LORA_MODULES, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
_READ_CHUNK = 1 << 20

_MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight, optionally with the adapter's
# name before ".weight" (lora_A.default.weight) and with fewer "model." prefixes.
_WEIGHT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z0-9_]+)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")

# Config fields whose feature changes the computation beyond y += scaling * B(A(x)): refused when set.
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "layers_to_transform": "layers_to_transform (LoRA on a subset of layers) is not supported",
    "layers_pattern": "layers_pattern is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (transposed weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}
# Any other `use_<feature>` switch turned on is a variant this engine does not compute.
_SUPPORTED_SWITCHES = {"use_rslora"}


def load_peft_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int,
                      *, base_model_aliases: Iterable[str] = ()) -> HostAdapter:
    """Read and validate a PEFT LoRA folder. Raises AdapterError with the reason when it is refused.

    `base_model_aliases` adds names the adapter's `base_model_name_or_path` may carry for this base
    model (for instance the served model name) besides the model folder's own name.
    """
    try:
        validate_adapter_name(name)
    except ValueError as exc:
        raise AdapterError(str(exc), param="lora_name") from None
    folder = Path(path)
    config = _read_config(folder)
    _check_features(config)
    _check_base_model(config, model, base_model_aliases)
    default_rank, alpha, use_rslora = _rank_and_alpha(config)
    _check_target_modules(config.get("target_modules"))
    weights_path = _weights_path(folder)
    tensors, digest = _read_safetensors(weights_path)
    pairs = _pair_weights(tensors, model)
    default_scaling = _scaling(alpha, default_rank, use_rslora)
    weights, ranks = {}, {}
    for (layer, module), (lora_a, lora_b) in sorted(pairs.items()):
        rank = _expected_rank(config, layer, module, default_rank)
        _check_pair(layer, module, lora_a, lora_b, rank, max_rank, model)
        scaling = _scaling(_expected_alpha(config, layer, module, alpha), rank, use_rslora)
        # HostAdapter carries one scaling; a module whose rank_pattern/alpha_pattern gives another
        # one has the ratio folded into its B matrix, which computes the same product.
        if scaling != default_scaling:
            lora_b = lora_b * (scaling / default_scaling)
        weights[(layer, module)] = (lora_a.contiguous(), lora_b.contiguous())
        ranks[module] = max(ranks.get(module, 0), rank)
    info = AdapterInfo(
        id=AdapterId(name, digest), rank=max(ranks.values()), size_bytes=weights_path.stat().st_size,
        target_modules=tuple(m for m in LORA_MODULES if m in ranks),
        base_model=config.get("base_model_name_or_path") or None, source=str(path),
        invocation_tokens=_invocation_tokens(config, model))
    return HostAdapter(info=info, scaling=default_scaling, weights=weights)


# ---- config ----

def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist or is not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{config_path} is missing: not a PEFT adapter folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} must hold a JSON object")
    peft_type = str(config.get("peft_type") or "").upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type is {config.get('peft_type')!r}; only LORA adapters are supported")
    return config


def _check_features(config: dict) -> None:
    for key, reason in _UNSUPPORTED_FEATURES.items():
        if config.get(key):
            raise AdapterError(f"{reason} (adapter_config.json has {key}={config[key]!r})")
    for key, value in config.items():
        if key.startswith("use_") and key not in _SUPPORTED_SWITCHES and value:
            raise AdapterError(f"{key} is not supported (adapter_config.json has {key}={value!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"bias={bias!r} is not supported; only bias='none' (no trained biases)")


def _invocation_tokens(config: dict, model: ModelConfig) -> tuple[int, ...]:
    """An activated LoRA's invocation token ids (PEFT's `alora_invocation_tokens`); () otherwise."""
    tokens = config.get("alora_invocation_tokens")
    if tokens is None:
        return ()
    valid = isinstance(tokens, list) and tokens and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.vocab_size for t in tokens)
    if not valid:
        raise AdapterError(f"alora_invocation_tokens must be a non-empty list of token ids below the vocabulary "
                           f"size {model.vocab_size}, not {tokens!r}")
    return tuple(tokens)


def _rank_and_alpha(config: dict) -> tuple[int, float, bool]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"rank r must be an integer >= 1, not {rank!r}")
    if not _is_number(alpha) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, not {alpha!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{field} must be a JSON object mapping module patterns to numbers")
        for key, value in pattern.items():
            if not _is_number(value) or value <= 0 or (field == "rank_pattern" and not isinstance(value, int)):
                raise AdapterError(f"{field}[{key!r}] must be a positive number, not {value!r}")
    return rank, float(alpha), bool(config.get("use_rslora", False))


def _check_target_modules(target_modules) -> None:
    """A list must name only supported modules; a regex string or "all-linear" is checked against
    the weights actually present instead (see _pair_weights)."""
    if target_modules is None or isinstance(target_modules, str):
        return
    if not isinstance(target_modules, list):
        raise AdapterError(f"target_modules must be a list or a string, not {target_modules!r}")
    unsupported = sorted({str(m) for m in target_modules if str(m).rsplit(".", 1)[-1] not in LORA_MODULES})
    if unsupported:
        raise AdapterError(f"target modules {unsupported} are not supported; LoRA is supported on "
                           f"{list(LORA_MODULES)}")


def _check_base_model(config: dict, model: ModelConfig, aliases: Iterable[str]) -> None:
    trained_on = config.get("base_model_name_or_path")
    if not trained_on:
        return  # the adapter does not say; shapes are still checked
    accepted = base_model_names(model.name, aliases)
    if _normalise(trained_on) not in accepted:
        raise AdapterError(
            f"adapter was trained on base model {trained_on!r}, but this server serves {model.name!r} "
            f"(names compared: {sorted(accepted)}); fix base_model_name_or_path in adapter_config.json "
            "if the base model is the same")


def base_model_names(model_name: str, aliases: Iterable[str] = ()) -> set[str]:
    """Normalised names a base model answers to: its folder's name (and, for a Hugging Face cache
    snapshot, the repository's name) plus the aliases."""
    names = {_normalise(model_name)} | {_normalise(a) for a in aliases if a}
    cache = re.search(r"models--[^/]+--([^/]+)/snapshots/", model_name.replace("\\", "/"))
    if cache:
        names.add(cache.group(1).lower())
    return names


def _normalise(name: str) -> str:
    """The last path component, lower-case: "meta-llama/Llama-3.1-8B/" -> "llama-3.1-8b"."""
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()


def _pattern_value(pattern: dict, layer: int, module: str):
    """PEFT's rule: the first key that matches the end of the module's full name, on a dot boundary."""
    full_name = f"model.layers.{layer}.{_MODULE_PARENT[module]}.{module}"
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", full_name):
            return value
    return None


def _expected_rank(config: dict, layer: int, module: str, default: int) -> int:
    value = _pattern_value(config.get("rank_pattern") or {}, layer, module)
    return default if value is None else int(value)


def _expected_alpha(config: dict, layer: int, module: str, default: float) -> float:
    value = _pattern_value(config.get("alpha_pattern") or {}, layer, module)
    return default if value is None else float(value)


def _scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---- weights ----

def _weights_path(folder: Path) -> Path:
    path = folder / WEIGHTS_FILE
    if path.is_file():
        return path
    if (folder / PICKLE_WEIGHTS_FILE).exists():
        raise AdapterError(f"{folder} has only {PICKLE_WEIGHTS_FILE}: pickle weights are not loaded; "
                           "convert them to safetensors (adapter_model.safetensors)")
    raise AdapterError(f"{path} is missing")


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors and "sha256:<hex>" of the file, from one streamed read (the digest is of exactly
    the bytes the tensors came from)."""
    from safetensors.torch import load as load_safetensors

    digest, data = hashlib.sha256(), bytearray()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            data += chunk
    try:
        tensors = load_safetensors(bytes(data))
    except Exception as exc:  # safetensors raises its own error type, or others for some corruptions
        raise AdapterError(f"{path} is not a valid safetensors file (corrupt or truncated): {exc}") from None
    return tensors, "sha256:" + digest.hexdigest()


def _pair_weights(tensors: dict[str, torch.Tensor], model: ModelConfig
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, kind = _parse_key(key, model)
        if not tensor.is_floating_point():
            raise AdapterError(f"{key} has dtype {tensor.dtype}; LoRA weights must be floating point")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{key} contains NaN or infinite values")
        found.setdefault((layer, module), {})[kind] = tensor.to(torch.float32)
    if not found:
        raise AdapterError("the weights file holds no LoRA weights")
    pairs = {}
    for (layer, module), parts in found.items():
        missing = {"A", "B"} - parts.keys()
        if missing:
            raise AdapterError(f"layer {layer} {module} has no lora_{missing.pop()} weight")
        pairs[(layer, module)] = (parts["A"], parts["B"])
    return pairs


def _parse_key(key: str, model: ModelConfig) -> tuple[int, str, str]:
    match = _WEIGHT_KEY.match(key)
    if not match:
        raise AdapterError(f"unsupported weight {key!r}: only lora_A/lora_B weights of decoder layers are "
                           f"supported, on {list(LORA_MODULES)}")
    module = match["module"]
    if module not in LORA_MODULES or _MODULE_PARENT[module] != match["parent"]:
        raise AdapterError(f"weight {key!r} targets module {match['parent']}.{module}, which is not supported; "
                           f"LoRA is supported on {list(LORA_MODULES)}")
    layer = int(match["layer"])
    if layer >= model.num_hidden_layers:
        raise AdapterError(f"weight {key!r} is for layer {layer}, but the base model has "
                           f"{model.num_hidden_layers} layers")
    return layer, module, match["kind"]


def _check_pair(layer: int, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int,
                max_rank: int, model: ModelConfig) -> None:
    in_features, out_features = model.module_shape(module)
    where = f"layer {layer} {module}"
    if lora_a.dim() != 2 or lora_b.dim() != 2:
        raise AdapterError(f"{where}: lora_A and lora_B must be matrices, got shapes "
                           f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    fits_model = lora_a.shape[1] == in_features and lora_b.shape[0] == out_features
    if fits_model and lora_a.shape[0] == lora_b.shape[1] != rank:
        raise AdapterError(f"{where}: the weights have rank {lora_a.shape[0]}, but adapter_config.json gives "
                           f"rank {rank} (r or rank_pattern)")
    if tuple(lora_a.shape) != (rank, in_features) or tuple(lora_b.shape) != (out_features, rank):
        raise AdapterError(
            f"{where}: lora_A {tuple(lora_a.shape)} / lora_B {tuple(lora_b.shape)} do not match the base "
            f"model and rank: expected ({rank}, {in_features}) / ({out_features}, {rank})")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} is larger than the maximum LoRA rank {max_rank} "
                           "(raise --max-lora-rank)")

