"""Request lengths: whole (prompt, output) rows resampled from the Azure traces, or fixed/uniform.

The traces are multimodal, so rows are resampled rather than fitted (workloads.md §2.1); resampling
whole rows keeps the joint distribution. Long requests are shaved pro rata to fit max_model_len.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from loraplex.sim.azure import load_azure


class Lengths(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile: Literal["azure23_conv", "azure23_code", "fixed", "uniform", "replay"] = "azure23_conv"
    prompt_len: int = Field(128, ge=1)  # fixed
    output_len: int = Field(64, ge=1)  # fixed
    uniform_range: tuple[int, int] = (8, 512)  # uniform: both lengths ~ U[lo, hi] (S-LoRA)
    scale: float = Field(1.0, gt=0)  # multiply both lengths (small models, CPU runs)
    max_model_len: int = Field(4096, ge=2)


def sample_lengths(spec: Lengths, count: int, rng: np.random.Generator,
                   traces_dir: str | None = None, replay_rows: np.ndarray | None = None,
                   replay_service: str = "conv") -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, output_len) arrays of `count` requests. `replay_rows` are the trace row indices
    of a replayed arrival stream (profile "replay" keeps each request's own lengths)."""
    if spec.profile == "fixed":
        prompt, output = np.full(count, spec.prompt_len), np.full(count, spec.output_len)
    elif spec.profile == "uniform":
        lo, hi = spec.uniform_range
        prompt, output = rng.integers(lo, hi + 1, count), rng.integers(lo, hi + 1, count)
    else:
        service = replay_service if spec.profile == "replay" else spec.profile.removeprefix("azure23_")
        trace = load_azure(service, traces_dir)
        rows = replay_rows if spec.profile == "replay" else rng.integers(0, len(trace), count)
        if rows is None:
            raise ValueError("lengths profile 'replay' needs arrivals.process 'replay'")
        prompt, output = trace.prompt_len[rows], trace.output_len[rows]
    return _fit(prompt * spec.scale, output * spec.scale, spec.max_model_len)


def _fit(prompt: np.ndarray, output: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Round to >= 1 token and shave prompt and output pro rata where their sum exceeds the limit
    (the engine needs prompt + output <= max_model_len, and a prompt shorter than it)."""
    total = prompt + output
    factor = np.minimum(1.0, (max_model_len - 1) / total)
    prompt = np.maximum(1, np.floor(prompt * factor)).astype(np.int64)
    output = np.maximum(1, np.floor(output * factor)).astype(np.int64)
    return prompt, output
