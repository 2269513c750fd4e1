"""Rotary position embeddings with the rope scalings Llama-family checkpoints use."""

from __future__ import annotations

import math

import torch

from loraplex_agent.runtime.model.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the config says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, in the model dtype."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inverse_frequencies(config))
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout, as HF Llama checkpoints expect
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows, 1, head_dim] for the step's positions (looked up once, used by every layer)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] rotated by its positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
