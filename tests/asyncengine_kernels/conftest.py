"""Kernel-test setup: Triton kernels run in the CPU interpreter when there is no GPU.

The repository-wide conftest sets TRITON_INTERPRET too; setting it here as well keeps
`tests/asyncengine_kernels` runnable on its own. It must be set before `asyncengine_kernels` is
imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    # The interpreter converts loaded loop bounds with a numpy call that numpy deprecates.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
    )
