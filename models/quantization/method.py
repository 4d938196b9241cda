"""The linear method of each weight format, vLLM's `LinearMethodBase` in this project's terms:
how a quantized linear layer of that format reads its checkpoint tensors, creates its
parameters, repacks them once loaded, which activation dtypes and devices it serves, and which
matmul kinds the start-up tuner times for it. The integer formats (GPTQ, AWQ,
compressed-tensors int4/int8) share one method (`models.quantization.layer`, `.kinds`,
`.formats`), FP8 has its own (`models.quantization.fp8`). `get_quant_method` picks it once
from a layer's `QuantConfig`; the loader, the linear layers and the tuner ask the method
rather than the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from models.matmul_plan import MatmulKind
from models.quantization import formats, fp8, kinds, layer
from models.quantization.config import Fp8QuantConfig, IntQuantConfig, QuantConfig


class QuantLinearMethod(ABC):
    """What one weight format does for its linear layers."""

    def create_weights(self, module: nn.Module, qc: QuantConfig, full_in: int) -> None:
        """Give `module` (its in/out features: the shard) the parameters its checkpoint
        tensors load into; `full_in`: the unsharded input width."""
        # The activation dtype: the model is built with it as the default dtype.
        module.params_dtype = torch.get_default_dtype()
        self._create(module, qc, full_in)

    @abstractmethod
    def _create(self, module: nn.Module, qc: QuantConfig, full_in: int) -> None: ...

    @abstractmethod
    def process_weights_after_loading(self, module: nn.Module) -> None:
        """Repack the loaded parameters for the kernels and give `module` its first plan."""

    def check_dtype(self, qc: QuantConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Refuse, before anything is allocated, an activation dtype or device the format's
        kernels do not serve."""
        layer.check_cuda_dtype(qc, dtype, device)

    @abstractmethod
    def read_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized layer's in the canonical form its
        parameters take (`models.quantization.formats`)."""

    @abstractmethod
    def tuning_kinds(self, module: nn.Module, rows: int) -> list[MatmulKind]:
        """The kinds the start-up tuner times for `module` at `rows` rows."""

    def fallback_kinds(self, module: nn.Module, rows: int) -> list[MatmulKind]:
        """The kinds the tuner times instead where every one of `tuning_kinds` disagrees with
        the reference (a kernel that fails on this GPU or for this layer): none by default,
        which leaves the reference planned there."""
        return []


class IntLinearMethod(QuantLinearMethod):
    """Weight-only int4/int8 (GPTQ, AWQ, compressed-tensors pack-quantized)."""

    def _create(self, module: nn.Module, qc: IntQuantConfig, full_in: int) -> None:
        layer.create_int_weights(module, qc, full_in)

    def process_weights_after_loading(self, module: nn.Module) -> None:
        layer.process_int_linear(module)

    def read_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], qc: IntQuantConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return formats.read_int_weights(weights, qc)

    def tuning_kinds(self, module: nn.Module, rows: int) -> list[MatmulKind]:
        return kinds.tuning_kinds(module, rows)

    def fallback_kinds(self, module: nn.Module, rows: int) -> list[MatmulKind]:
        return kinds.fallback_kinds(module, rows)


class Fp8LinearMethod(QuantLinearMethod):
    """e4m3 weights with per-channel scales, W8A8 (or W8A16 for a few rows)."""

    def _create(self, module: nn.Module, qc: Fp8QuantConfig, full_in: int) -> None:
        fp8.create_fp8_weights(module, qc)

    def process_weights_after_loading(self, module: nn.Module) -> None:
        fp8.process_fp8_linear(module)

    def check_dtype(self, qc: QuantConfig, dtype: torch.dtype, device: torch.device) -> None:
        fp8.check_fp8_device(device)
        super().check_dtype(qc, dtype, device)

    def read_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], qc: Fp8QuantConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return formats.read_fp8_weights(weights, qc)

    def tuning_kinds(self, module: nn.Module, rows: int) -> list[MatmulKind]:
        return fp8.tuning_kinds(module, rows)


_INT = IntLinearMethod()
_FP8 = Fp8LinearMethod()


def get_quant_method(qc: QuantConfig) -> QuantLinearMethod:
    """The linear method of `qc`'s format."""
    return _FP8 if isinstance(qc, Fp8QuantConfig) else _INT
