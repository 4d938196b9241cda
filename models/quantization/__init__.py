"""Weight-only quantized checkpoints: GPTQ, AWQ and compressed-tensors int4/int8.

`config` reads the format from config.json, `formats` turns each format's packed tensors into
one canonical form, `layer` gives linear layers those parameters and repacks them for the
kernels (`kernels.quant_linear`), and `kinds` are the matmul-plan kinds that run them.
"""

from models.quantization.config import (
    QUANT_METHODS,
    QuantConfig,
    current_quant_config,
    parse_quant_config,
    set_current_quant_config,
)

__all__ = [
    "QUANT_METHODS",
    "QuantConfig",
    "current_quant_config",
    "parse_quant_config",
    "set_current_quant_config",
]
