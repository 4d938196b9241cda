"""Each weight format's linear method: chosen once from the config, and what it does for a
layer (its parameters, its dtype check, its tuner's kinds) is its format's."""

from __future__ import annotations

import pytest
import torch

from models.layers import ColumnParallelLinear
from models.quantization import fp8, kinds
from models.quantization.config import Fp8QuantConfig, IntQuantConfig, QuantConfig
from models.quantization.method import Fp8LinearMethod, IntLinearMethod, get_quant_method

INT_CONFIGS = [IntQuantConfig("gptq", 4, 128), IntQuantConfig("awq", 4, 128, sym=False),
               IntQuantConfig("compressed-tensors", 8, -1)]  # fmt: skip
FP8 = Fp8QuantConfig(activation="dynamic", source="online")


@pytest.mark.parametrize("qc", INT_CONFIGS)
def test_integer_formats_share_the_integer_method(qc: QuantConfig) -> None:
    assert isinstance(get_quant_method(qc), IntLinearMethod)


def test_fp8_has_its_own_method() -> None:
    assert isinstance(get_quant_method(FP8), Fp8LinearMethod)


def _layer(qc: QuantConfig, n: int = 256, k: int = 512) -> ColumnParallelLinear:
    return ColumnParallelLinear(k, n, quant_config=qc)


def test_each_method_creates_its_formats_parameters() -> None:
    """The integer method's canonical codes, scales and zero points; FP8's e4m3 weight and
    channel scales; both record the activation dtype the model is built in."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        int_layer, fp8_layer = _layer(INT_CONFIGS[0]), _layer(FP8)
    finally:
        torch.set_default_dtype(previous)
    assert int_layer.params_dtype == fp8_layer.params_dtype == torch.bfloat16
    assert int_layer.weight.dtype == torch.uint8 and int_layer.weight.shape == (256, 512)
    assert int_layer.weight_scale.shape == int_layer.weight_zero.shape == (256, 4)
    assert fp8_layer.weight.dtype == torch.float8_e4m3fn
    assert not hasattr(fp8_layer, "weight_zero")


def test_each_method_names_its_formats_tuning_kinds() -> None:
    """The tuner asks the layer's method: integer rules for an integer layer, FP8's for FP8."""
    int_layer = _layer(INT_CONFIGS[0])
    get_quant_method(int_layer.quant_config).process_weights_after_loading(int_layer)
    fp8_layer = _layer(FP8)
    fp8_layer.weight.data.zero_()
    fp8_layer.weight_scale.data.fill_(1.0)
    get_quant_method(FP8).process_weights_after_loading(fp8_layer)
    for rows in (1, 16, 256):
        assert get_quant_method(int_layer.quant_config).tuning_kinds(int_layer, rows) == \
            kinds.tuning_kinds(int_layer, rows)
        assert get_quant_method(FP8).tuning_kinds(fp8_layer, rows) == \
            fp8.tuning_kinds(fp8_layer, rows)


def test_both_methods_refuse_float32_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both refuse a float32 model on CUDA; FP8 first checks the GPU's FP8 tensor cores
    (stood in for here: this machine has no GPU to ask)."""
    checked: list[torch.device] = []
    monkeypatch.setattr(fp8, "check_fp8_device", checked.append)
    for qc in (INT_CONFIGS[0], FP8):
        method = get_quant_method(qc)
        method.check_dtype(qc, torch.float32, torch.device("cpu"))
        with pytest.raises(ValueError, match="need dtype float16 or bfloat16"):
            method.check_dtype(qc, torch.float32, torch.device("cuda"))
    assert checked == [torch.device("cpu"), torch.device("cuda")]
