"""The quantized plan kinds against their reference, and the agreement check the start-up
tuner runs before timing a kind: a kind giving NaN or wrong values is never planned."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kernels.quant_linear import QuantGemmConfig, QuantGemvConfig
from models.config import ModelConfig
from models.loader import load_model
from models.matmul_plan import MatmulKind
from models.quantization.kinds import (
    DequantMatmul,
    QuantTritonGemm,
    QuantTritonGemv,
    QuantTritonGemvAtOnce,
    agrees_with_reference,
    tuning_kinds,
)
from tests.quant_writers import Scheme

Make = Callable[[Scheme], tuple[Path, Path]]


@dataclass(frozen=True)
class _Corrupted(MatmulKind):
    """The reference with one output value replaced (NaN, or off by a large amount)."""

    value: float
    name: ClassVar[str] = "corrupted"

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, *,
              gated: bool = False, glu: bool = False) -> torch.Tensor:  # fmt: skip
        y = DequantMatmul().apply(layer, x, bias).clone()
        y[-1, 0] = self.value if self.value != self.value else y[-1, 0] + self.value
        return y


def _down_proj(quantized: Make, scheme: Scheme) -> torch.nn.Module:
    qdir, _ = quantized(scheme)
    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, dtype=torch.float32, device=torch.device("cpu"))
    return model.model.layers[0].mlp.down_proj


def test_the_triton_kinds_agree_and_a_corrupted_one_does_not(quantized: Make) -> None:
    layer = _down_proj(quantized, Scheme("gptq", 8, 32, sym=True))
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert agrees_with_reference(QuantTritonGemm(QuantGemmConfig(16, 32, 32, 4, 1)), layer,
                                 x, None)  # fmt: skip
    assert agrees_with_reference(QuantTritonGemv(QuantGemvConfig(32, 32, 2)), layer, x, None)
    scale = float(DequantMatmul().apply(layer, x, None).abs().max())
    assert agrees_with_reference(_Corrupted(0.001 * scale), layer, x, None)
    assert not agrees_with_reference(_Corrupted(0.5 * scale), layer, x, None)
    assert not agrees_with_reference(_Corrupted(float("nan")), layer, x, None)


def test_the_at_once_gemv_applies_silu_and_mul_itself(quantized: Make) -> None:
    """The down projection's [gate, up] input: the at-once GEMV fused, as the reference
    takes the activated input; the tuner offers it with the fusion declared."""
    from kernels.activation import silu_and_mul
    from models.matmul_plan import InputTransform

    layer = _down_proj(quantized, Scheme("gptq", 4, 32, sym=True))
    pair = torch.randn(1, 2 * layer.in_features, generator=torch.Generator().manual_seed(1))
    pair = pair.to(torch.bfloat16)
    layer.scales.data = layer.scales.data.to(torch.bfloat16)
    layer.zeros.data = layer.zeros.data.to(torch.bfloat16)
    kind = QuantTritonGemvAtOnce(QuantGemvConfig(32, 32, pairs=True, tiles=2))
    assert InputTransform.SILU_AND_MUL in kind.fusable_inputs
    want = DequantMatmul().apply(layer, silu_and_mul(pair).float(), None)
    got = kind.apply(layer, pair, None, gated=True).float()
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    # Every at-once config the tuner times is offered as the kind that can fuse.
    gemvs = [k for k in tuning_kinds(layer, 1) if isinstance(k, QuantTritonGemv)]
    assert gemvs
    assert all(isinstance(k, QuantTritonGemvAtOnce) == bool(k.config.tiles) for k in gemvs)
