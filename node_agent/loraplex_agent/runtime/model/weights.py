"""Read a Hugging Face checkpoint's tensors from safetensors files (never pickle)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.spec.errors import InvalidRequestError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index, or the single file."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (root / s).exists()]
        if missing:
            raise InvalidRequestError(f"{root}: shards named in {INDEX_FILE} are missing: {missing}")
        return [root / s for s in shards]
    if (root / SINGLE_FILE).exists():
        return [root / SINGLE_FILE]
    raise InvalidRequestError(
        f"{root} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors checkpoints are supported")


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on the CPU, in its stored dtype."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_state_dict(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors by name, cast to `dtype` and moved to `device` one at a time."""
    return {name: t.to(device=device, dtype=dtype) for name, t in iter_tensors(model_dir)}
