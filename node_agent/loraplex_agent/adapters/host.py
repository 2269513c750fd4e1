"""An adapter's weights in host memory, ready to be copied into a device slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.spec.adapter import AdapterId, AdapterInfo


@dataclass
class HostAdapter:
    info: AdapterInfo
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    # (layer index, module name) -> (lora_A [rank, in_features], lora_B [out_features, rank]), PEFT layout
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def id(self) -> AdapterId:
        return self.info.id

    @property
    def rank(self) -> int:
        return self.info.rank
