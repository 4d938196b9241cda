"""Quantized weights: GPTQ, AWQ and compressed-tensors int4/int8 (weight-only), and FP8 e4m3
(W8A8: compressed-tensors float-quantized, vLLM-style fp8, or quantized at load).

`config` reads the format from config.json, `method` is each format's linear method (what
the loader, the linear layers and the tuner ask of a quantized layer), `formats` turns each
format's tensors into one canonical form, `layer` gives linear layers those integer parameters
and repacks them for the kernels (`asyncengine_kernels.quant_linear`), `kinds` are the
matmul-plan kinds that run them, and `fp8` holds FP8's parameters, repacking and kinds
(`asyncengine_kernels.fp8_linear`).
"""

from models.quantization.config import (
    QUANT_METHODS,
    Fp8QuantConfig,
    IntQuantConfig,
    QuantConfig,
    parse_quant_config,
)

__all__ = [
    "QUANT_METHODS",
    "Fp8QuantConfig",
    "IntQuantConfig",
    "QuantConfig",
    "parse_quant_config",
]
