"""`quantization_config` is read as each tool writes it; anything not served is refused with
the field and its value named, and an explicit `quantization=` must agree."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from asyncengine.config import EngineArgs
from models.quantization.config import QuantConfig, parse_quant_config
from models.quantization.layer import check_quantized_dtype

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
    assert parse_quant_config(_cfg(GPTQ)) == QuantConfig("gptq", 4, 128, sym=True)
    assert parse_quant_config(_cfg(GPTQ, bits=8, group_size=-1, sym=False, desc_act=True)) == (
        QuantConfig("gptq", 8, -1, sym=False, desc_act=True)
    )
    assert parse_quant_config(_cfg(AWQ, group_size=64)) == QuantConfig("awq", 4, 64, sym=False)
    w = "config_groups__group_0__weights__"
    assert parse_quant_config(_cfg(CT)) == QuantConfig("compressed-tensors", 4, 128)
    channel = _cfg(CT, **{w + "num_bits": 8, w + "strategy": "channel", w + "group_size": None})
    assert parse_quant_config(channel) == QuantConfig("compressed-tensors", 8, -1)
    assert parse_quant_config({"hidden_size": 8}) is None


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
        (_cfg(CT, format="float-quantized"), "format='float-quantized'"),
        (_cfg(CT, format="naive-quantized"), "format='naive-quantized'"),
        (_cfg(CT, **{W + "symmetric": False}), "weights.symmetric=False"),
        (_cfg(CT, **{W + "num_bits": 2}), "weights.num_bits=2"),
        (_cfg(CT, **{W + "type": "float"}), "weights.type='float'"),
        (_cfg(CT, **{W + "strategy": "tensor"}), "weights.strategy='tensor'"),
        (_cfg(CT, **{W + "actorder": "group"}), "weights.actorder='group'"),
        (_cfg(CT, **{"config_groups__group_0__input_activations": {"num_bits": 8}}),
         "input_activations="),
        (_cfg(CT, ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore="),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
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
    with pytest.raises(ValueError, match="quantization='int3' is not supported"):
        parse_quant_config(_cfg(GPTQ), "int3")


def test_engine_args_accept_the_served_methods() -> None:
    for method in (None, "none", "gptq", "awq", "compressed-tensors"):
        EngineArgs(quantization=method)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="fp4")


def test_cuda_kernels_refuse_a_float32_model_before_building_it() -> None:
    qc = QuantConfig("gptq", 4, 128)
    check_quantized_dtype(qc, torch.bfloat16, torch.device("cuda"))
    check_quantized_dtype(qc, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="gptq weights on CUDA need dtype float16 or bfloat16"):
        check_quantized_dtype(qc, torch.float32, torch.device("cuda"))
