"""Kernel tests run the Triton kernels in Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before anything imports triton (kernels are wrapped at decoration),
so this happens here, at collection, before the test modules import the kernels.
"""

from __future__ import annotations

import os

import torch
from triton_interpreter import patch_interpreter_index

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_interpreter_index()
