"""The executor seam: runs one scheduled step. Torch on CPU/CUDA, or simulated."""

from __future__ import annotations

from typing import Protocol

from loraplex.engine.messages import ExecutorResult, SchedulerOutput


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        """Apply adapter evictions and loads, run the chunks through the model, and sample one
        token for every chunk with `sample=True`. Never makes policy decisions."""
