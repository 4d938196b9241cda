"""Kernel-test setup: run Triton kernels in the CPU interpreter when there is no GPU.

The variable must be set before any `@triton.jit` decorator runs, i.e. before `kernels` is
imported; the repository-wide conftest does the same, this keeps `tests/kernels` runnable alone.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
