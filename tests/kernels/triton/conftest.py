"""Triton kernel tests: on a machine without CUDA they run in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here,
before any test module imports pagoda.kernels.triton_ops.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
