"""A profile: the fitted step-latency model of one (model, hardware, engine settings) triple.

A profile is a versioned JSON file written by `loraplex profile` (which runs the real engine) and
read by the simulator. Step latency is linear in the features of `loraplex.latency.features`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.engine.config import EngineConfig
from loraplex.latency.features import FEATURES, StepFeatures

PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class FitReport(BaseModel):
    samples: int
    r2: float
    mape: float  # mean absolute percentage error of the step latency on the samples
    total_time_error: float  # (predicted - measured) summed step time / measured


class Memory(BaseModel):
    """Device memory in KV tokens: adapter slots (max_loras x max_lora_rank) take from the KV cache.

    The byte terms are optional (older profiles lack them): with them the twin sizes an adapter in
    pages of the unified pool and charges host <-> device copies at `h2d_gbps`."""

    kv_tokens_base: int = Field(ge=1)  # KV tokens with no adapter slots
    kv_tokens_per_slot_rank: float = Field(0.0, ge=0)  # KV tokens one slot of rank 1 costs
    kv_token_bytes: int | None = Field(None, ge=1)  # K and V of one token, all layers
    adapter_bytes_per_rank: int | None = Field(None, ge=1)  # one rank of an adapter, all layers and modules
    h2d_gbps: float | None = Field(None, gt=0)  # host <-> device copy bandwidth, GB/s (1e9 bytes)

    def kv_tokens(self, max_loras: int, max_lora_rank: int) -> int:
        return int(self.kv_tokens_base - self.kv_tokens_per_slot_rank * max_loras * max_lora_rank)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile_version: int = PROFILE_VERSION
    name: str
    model: str  # what was profiled, e.g. "tiny-llama (hidden 256, 4 layers)"
    hardware: str
    engine: dict  # the EngineConfig fields the profile was taken with
    memory: Memory
    coefficients: dict[str, float]  # seconds per unit of each feature
    fit: FitReport | None = None

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if self.profile_version != PROFILE_VERSION:
            raise ValueError(f"profile_version {self.profile_version} is not supported "
                             f"(this loraplex reads version {PROFILE_VERSION})")
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown latency terms {sorted(unknown)}; known: {list(FEATURES)}")
        return self

    def adapter_pages(self, rank: int, block_size: int) -> int:
        """Device pages (KV blocks of `block_size` tokens) an adapter of `rank` takes in the unified
        pool: its bytes over a page's, rounded up. Without byte terms the slot model's
        `kv_tokens_per_slot_rank` says the same thing in tokens."""
        memory = self.memory
        if memory.adapter_bytes_per_rank is not None and memory.kv_token_bytes is not None:
            return math.ceil(rank * memory.adapter_bytes_per_rank / (block_size * memory.kv_token_bytes))
        return math.ceil(rank * memory.kv_tokens_per_slot_rank / block_size)

    def adapter_bytes(self, rank: int) -> int:
        """Bytes an adapter of `rank` moves when copied to the device (0 when the profile cannot say)."""
        memory = self.memory
        if memory.adapter_bytes_per_rank is not None:
            return rank * memory.adapter_bytes_per_rank
        if memory.kv_token_bytes is not None:
            return int(rank * memory.kv_tokens_per_slot_rank * memory.kv_token_bytes)
        return 0

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one KV block (all layers); 0 when the profile does not know a token's size."""
        return block_size * (self.memory.kv_token_bytes or 0)

    def copy_seconds(self, nbytes: float) -> float:
        """Host <-> device time of `nbytes` at the profile's bandwidth (0 without one)."""
        gbps = self.memory.h2d_gbps
        return nbytes / (gbps * 1e9) if gbps else 0.0

    def weights(self) -> list[float]:
        return [self.coefficients.get(name, 0.0) for name in FEATURES]

    def scaled(self, factor: float) -> Profile:
        """The same model on a machine `factor` times slower (every term scales alike)."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be positive, not {factor}")
        return self.model_copy(update={"coefficients": {k: v * factor for k, v in self.coefficients.items()}})

    def step_seconds(self, features: StepFeatures) -> float:
        return sum(w * x for w, x in zip(self.weights(), features.vector(), strict=True))

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The engine settings of the profile, with the KV cache sized from memory. A profile was
        measured with fixed adapter slots (`lru-static`) unless it says otherwise; only then do the
        slots take their memory from the KV cache."""
        fields = {"memory_policy": "lru-static", **self.engine, **overrides}
        if "num_blocks" not in overrides:
            slots = int(fields["max_loras"]) if fields["memory_policy"] == "lru-static" else 0
            tokens = self.memory.kv_tokens(slots, int(fields["max_lora_rank"]))
            fields["num_blocks"] = max(1, tokens // int(fields["block_size"]))
        return EngineConfig(**fields)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile file, or the name of a shipped one (e.g. "cpu-tiny")."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILES_DIR / f"{name_or_path}.json"
        if not shipped.is_file():
            raise FileNotFoundError(f"profile {name_or_path!r} not found (neither a file nor one of "
                                    f"{sorted(p.stem for p in PROFILES_DIR.glob('*.json'))})")
        path = shipped
    try:
        return Profile.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid profile: {exc}") from None
