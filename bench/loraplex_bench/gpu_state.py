"""What the parts of the GPU run (`loraplex_bench.gpu_run`) share: the device, the shape and its sizes,
the random model (written once, on first use), the measured copy bandwidth, the engines' recorded
steps (part 7 fits the twin's profile on them) and the earlier parts' results."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.tools.profile import RecordingExecutor

from loraplex.engine.core import EngineCore
from loraplex.latency.features import StepFeatures
from loraplex_bench import gpu
from loraplex_bench.gpu_sizes import Sizes

WARMUP_STEPS = 2  # of each engine, left out of the profile's samples


@dataclass
class GpuRun:
    """What the parts share: the device, the shape, the random model (written once, on first use),
    the copy bandwidth, the steps recorded for part 7's profile and the earlier parts' results."""

    args: argparse.Namespace
    device: torch.device
    shape: str
    sizes: Sizes
    workdir: Path
    out: Path
    deadline: float = 0.0  # perf_counter() at which the running part's budget ends
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    samples: list[tuple[StepFeatures, float]] = field(default_factory=list)  # every recorded step
    shared: dict[str, Any] = field(default_factory=dict)  # part 6's workloads, for part 7's twin
    steps_recorded: dict[int, int] = field(default_factory=dict)  # part -> its engines' recorded steps
    _model_dir: Path | None = None
    _bandwidth: float | None = None
    _adapter_weights: gpu.AdapterWeights | None = None
    setup_s: dict[str, float] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def config(self) -> ModelConfig:
        return gpu.model_config(self.shape)

    def over(self) -> bool:
        return time.perf_counter() > self.deadline

    def model_dir(self) -> Path:
        """The random model of the shape, written on first use (its time is reported as setup)."""
        if self._model_dir is None:
            began = time.perf_counter()
            self._model_dir = gpu.write_random_model(self.config, gpu.SHAPES[self.shape], self.workdir / "model",
                                                     self.args.seed, self.device)
            self.setup_s["model_write_s"] = time.perf_counter() - began
            print(f"setup: random {self.shape} model written in {self.setup_s['model_write_s']:.1f} s", flush=True)
        return self._model_dir

    def bandwidth(self) -> float:
        """Bytes/s of a device-to-device copy (read + write), measured once."""
        if self._bandwidth is None:
            self._bandwidth = gpu.device_bandwidth(self.device, (1 << 30) if self.cuda else (1 << 26))
            print(f"setup: measured copy bandwidth {self._bandwidth / 1e9:.0f} GB/s", flush=True)
        return self._bandwidth

    def adapter_weights(self) -> gpu.AdapterWeights:
        if self._adapter_weights is None:
            self._adapter_weights = gpu.AdapterWeights(self.config, self.device, self.args.seed)
        return self._adapter_weights

    def bench(self, num_blocks: int, cuda_graphs: bool, **engine: Any) -> gpu.Bench:
        """A fresh engine over the random model, its steps recorded for part 7."""
        bench = gpu.Bench(self.config, self.model_dir(), self.device, self.dtype, engine.pop("max_model_len"),
                          num_blocks, cuda_graphs and self.cuda, self.args.seed, self.adapter_weights(), **engine)
        if cuda_graphs or not self.cuda:  # the profile is of the engine as it serves: graphs on
            record_steps(bench.core, self.samples)
        return bench

    def free(self) -> None:
        """Give the device memory of closed engines back before the next one is built."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def record_steps(core: EngineCore, samples: list[tuple[StepFeatures, float]]) -> None:
    """Append (features, seconds) of every step `core` executes with requests in it to `samples`, but
    its first WARMUP_STEPS (first-use work: allocations, kernels compiled for a new shape); a step
    that only waits for a copy has no features (the twin charges copies by their bytes)."""
    recorder = RecordingExecutor(core.executor)
    core.executor = recorder
    step = core.step
    seen = [0]

    def timed_step() -> list:
        recorder.last = None
        began = time.perf_counter()
        outputs = step()
        elapsed = time.perf_counter() - began
        if recorder.last is not None and recorder.last.batch:
            seen[0] += 1
            if seen[0] > WARMUP_STEPS:
                samples.append((recorder.last, elapsed))
        return outputs

    core.step = timed_step  # type: ignore[method-assign]
