"""`quantization_config` is read as each tool writes it; anything not served is refused with
the field and its value named, and an explicit `quantization=` must agree."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from asyncengine.config import EngineArgs
from models.quantization.config import (
    Fp8QuantConfig,
    IntQuantConfig,
    parse_quant_config,
)
from models.quantization.method import get_quant_method

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}  # fmt: skip
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}  # fmt: skip
CT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 128, "dynamic": False, "actorder": None},
    }},
}  # fmt: skip


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
_FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
CT_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None, "format": "float-quantized",
        "weights": {**_FLOAT8, "strategy": "channel", "dynamic": False},
        "input_activations": {**_FLOAT8, "strategy": "token", "dynamic": True},
    }},
}  # fmt: skip
A = "config_groups__group_0__input_activations"


def _cfg(q: dict[str, Any], **changes: Any) -> dict[str, Any]:
    q = copy.deepcopy(q)
    for path, value in changes.items():
        *parents, key = path.split("__")
        d = q
        for p in parents:
            d = d[p]
        d[key] = value
    return {"quantization_config": q}


def test_formats_as_written() -> None:
    assert parse_quant_config(_cfg(GPTQ)) == IntQuantConfig("gptq", 4, 128, sym=True)
    assert parse_quant_config(_cfg(GPTQ, bits=8, group_size=-1, sym=False, desc_act=True)) == (
        IntQuantConfig("gptq", 8, -1, sym=False, desc_act=True)
    )
    assert parse_quant_config(_cfg(AWQ, group_size=64)) == IntQuantConfig("awq", 4, 64, sym=False)
    w = "config_groups__group_0__weights__"
    assert parse_quant_config(_cfg(CT)) == IntQuantConfig("compressed-tensors", 4, 128)
    channel = _cfg(CT, **{w + "num_bits": 8, w + "strategy": "channel", w + "group_size": None})
    assert parse_quant_config(channel) == IntQuantConfig("compressed-tensors", 8, -1)
    assert parse_quant_config({"hidden_size": 8}) is None


def test_fp8_formats_as_written() -> None:
    dynamic = Fp8QuantConfig(activation="dynamic", source="fp8")
    assert parse_quant_config(_cfg(FP8)) == dynamic
    assert parse_quant_config({"quantization_config": {"quant_method": "fp8"}}) == dynamic
    assert parse_quant_config(_cfg(FP8, activation_scheme="static"), "fp8") == Fp8QuantConfig(
        activation="static", source="fp8"
    )
    ct = Fp8QuantConfig(activation="dynamic", source="compressed-tensors")
    assert parse_quant_config(_cfg(CT_FP8)) == ct
    # Either name asks for a compressed-tensors FP8 checkpoint.
    assert parse_quant_config(_cfg(CT_FP8), "fp8") == parse_quant_config(
        _cfg(CT_FP8), "compressed-tensors") == ct  # fmt: skip
    static = _cfg(CT_FP8, **{W + "strategy": "tensor", A + "__strategy": "tensor",
                             A + "__dynamic": False})  # fmt: skip
    assert parse_quant_config(static).activation == "static"
    online = parse_quant_config({"hidden_size": 8}, "fp8")
    assert online == Fp8QuantConfig(activation="dynamic", source="online")
    assert online.describe() == "fp8 e4m3 per-channel (quantized at load), per-token activations"


W = "config_groups__group_0__weights__"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_cfg(GPTQ, bits=3), "bits=3"),
        (_cfg(GPTQ, bits=2), "bits=2"),
        (_cfg(GPTQ, group_size=16), "group_size=16"),
        (_cfg(GPTQ, checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'"),
        (_cfg(GPTQ, is_marlin_format=True), "is_marlin_format=True"),
        (_cfg(GPTQ, pack_dtype="int16"), "pack_dtype='int16'"),
        (_cfg(GPTQ, lm_head=True), "lm_head=True"),
        (_cfg(AWQ, bits=8), "bits=8"),
        (_cfg(AWQ, version="gemv"), "version='gemv'"),
        (_cfg(AWQ, version="exllama"), "version='exllama'"),
        (_cfg(AWQ, zero_point=False), "zero_point=False"),
        (_cfg(CT, format="float-quantized"), "weights.type='int'"),
        (_cfg(CT, format="naive-quantized"), "format='naive-quantized'"),
        (_cfg(CT, **{W + "symmetric": False}), "weights.symmetric=False"),
        (_cfg(CT, **{W + "num_bits": 2}), "weights.num_bits=2"),
        (_cfg(CT, **{W + "type": "float"}), "weights.type='float'"),
        (_cfg(CT, **{W + "strategy": "tensor"}), "weights.strategy='tensor'"),
        (_cfg(CT, **{W + "actorder": "group"}), "weights.actorder='group'"),
        (_cfg(CT, **{"config_groups__group_0__input_activations": {"num_bits": 8}}),
         "input_activations="),
        (_cfg(CT, ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore="),
        (_cfg(FP8, weight_block_size=[128, 128]), r"weight_block_size=\[128, 128\]"),
        (_cfg(FP8, activation_scheme="per-group"), "activation_scheme='per-group'"),
        (_cfg(FP8, fmt="e5m2"), "fmt='e5m2'"),
        (_cfg(FP8, ignored_layers=["model.layers.0.mlp.down_proj"]), "ignored_layers="),
        (_cfg(CT_FP8, **{W + "type": "int"}), "weights.type='int'"),
        (_cfg(CT_FP8, **{W + "num_bits": 4}), "weights.num_bits=4"),
        (_cfg(CT_FP8, **{W + "symmetric": False}), "weights.symmetric=False"),
        (_cfg(CT_FP8, **{W + "strategy": "block"}), "weights.strategy='block'"),
        (_cfg(CT_FP8, **{W + "strategy": "group"}), "weights.strategy='group'"),
        (_cfg(CT_FP8, **{W + "dynamic": True}), "weights.dynamic=True"),
        (_cfg(CT_FP8, **{A: None}), "input_activations=None"),
        (_cfg(CT_FP8, **{A + "__strategy": "group"}), "input_activations.strategy='group'"),
        (_cfg(CT_FP8, **{A + "__dynamic": False}), "input_activations.dynamic=False"),
        (_cfg(CT_FP8, **{A + "__symmetric": False}), "input_activations.symmetric=False"),
        (_cfg(CT_FP8, **{"config_groups__group_0__format": "pack-quantized"}),
         "group_0.format='pack-quantized'"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method="),
    ],
)  # fmt: skip
def test_unserved_options_are_refused_by_name(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match="quantization_config .*" + field.replace("(", r"\(")):
        parse_quant_config(raw)


def test_an_explicit_quantization_must_agree_with_the_checkpoint() -> None:
    assert parse_quant_config(_cfg(GPTQ), "gptq") == parse_quant_config(_cfg(GPTQ))
    with pytest.raises(ValueError, match="quantization='awq' was asked for, but the checkpoint "
                                         "is 'gptq'"):  # fmt: skip
        parse_quant_config(_cfg(GPTQ), "awq")
    with pytest.raises(ValueError, match="no quantization_config"):
        parse_quant_config({}, "gptq")
    with pytest.raises(ValueError, match="quantization='fp8' was asked for, but the checkpoint "
                                         "is 'gptq'"):  # fmt: skip
        parse_quant_config(_cfg(GPTQ), "fp8")
    with pytest.raises(ValueError, match="quantization='int3' is not supported"):
        parse_quant_config(_cfg(GPTQ), "int3")


def test_engine_args_accept_the_served_methods() -> None:
    for method in (None, "none", "gptq", "awq", "compressed-tensors", "fp8"):
        EngineArgs(quantization=method)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="fp4")


def test_cuda_kernels_refuse_a_float32_model_before_building_it() -> None:
    qc = IntQuantConfig("gptq", 4, 128)
    method = get_quant_method(qc)
    method.check_dtype(qc, torch.bfloat16, torch.device("cuda"))
    method.check_dtype(qc, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="gptq weights on CUDA need dtype float16 or bfloat16"):
        method.check_dtype(qc, torch.float32, torch.device("cuda"))
