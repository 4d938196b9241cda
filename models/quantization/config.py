"""Which weight format a checkpoint is in, read from `quantization_config` in config.json.

`parse_quant_config` accepts GPTQ (v1 checkpoint format, 4/8 bits), AWQ (GEMM, 4 bits),
compressed-tensors W4A16/W8A16 `pack-quantized` (group or channel strategy) and FP8 e4m3
weights: compressed-tensors `float-quantized` and the `quant_method: "fp8"` config of
vLLM-style checkpoints, or `quantization="fp8"` on a 16-bit checkpoint (quantized at load).
Anything else is refused with the field and its value named: a format served with the wrong
convention gives fluent-looking garbage, so nothing is guessed. The model hands the parsed
config (`ModelConfig.quantization`) to each linear layer it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The `quantization=` values an engine accepts, besides None.
QUANT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight format: its method (`QUANT_METHODS`) and bits per weight. The
    formats' own fields are on `IntQuantConfig` and `Fp8QuantConfig`."""

    method: str
    bits: int

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class IntQuantConfig(QuantConfig):
    """A weight-only integer format: `bits` per weight, one scale (and zero point) per
    `group_size` input columns (-1: one per output channel).

    sym: the zero point is 2^(bits-1) for every group (GPTQ still stores it); desc_act: GPTQ's
    act-order, the groups follow a permutation of the input columns given by `g_idx`."""

    group_size: int = 128
    sym: bool = True
    desc_act: bool = False

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def group_size_for(self, in_features: int) -> int:
        """Input columns per group in a layer with `in_features` inputs (its full width)."""
        return in_features if self.group_size == -1 else self.group_size

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = ", act-order" if self.desc_act else ""
        sym = "sym" if self.sym else "asym"
        return f"{self.method} int{self.bits} {group} {sym}{extra}"


@dataclass(frozen=True)
class Fp8QuantConfig(QuantConfig):
    """FP8 e4m3 weights, one scale per output channel: `activation` is how the W8A8 GEMMs
    quantize their input, "dynamic" (per token) or "static" (one `input_scale` per layer
    from the checkpoint); `source` is where the e4m3 weights come from: "online" (a 16-bit
    checkpoint, quantized at load), "fp8" or "compressed-tensors" (the checkpoint)."""

    method: str = "fp8"
    bits: int = 8
    activation: str = "dynamic"
    source: str = "online"

    def describe(self) -> str:
        where = "quantized at load" if self.source == "online" else f"{self.source} checkpoint"
        act = "per-token" if self.activation == "dynamic" else "static per-tensor"
        return f"fp8 e4m3 per-channel ({where}), {act} activations"


def _refuse(field: str, value: Any, served: str) -> ValueError:
    return ValueError(f"quantization_config {field}={value!r} is not supported ({served})")


def _group_size(field: str, value: Any) -> int:
    if value in (32, 64, 128, -1):
        return int(value)
    raise _refuse(field, value, "32, 64, 128 or -1 are")


def _parse_gptq(q: dict[str, Any]) -> IntQuantConfig:
    bits = q.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "GPTQ 4 and 8 bits are")
    fmt = q.get("checkpoint_format", q.get("format", "gptq"))
    if fmt != "gptq":
        raise _refuse("checkpoint_format", fmt, "only the v1 'gptq' checkpoint format is")
    if q.get("is_marlin_format"):
        raise _refuse("is_marlin_format", True, "only the v1 'gptq' checkpoint format is")
    if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _refuse("pack_dtype", q.get("pack_dtype"), "int32 words are")
    if q.get("lm_head"):
        raise _refuse("lm_head", q.get("lm_head"), "the LM head stays 16-bit")
    return IntQuantConfig(
        "gptq", int(bits), _group_size("group_size", q.get("group_size", 128)),
        sym=bool(q.get("sym", True)), desc_act=bool(q.get("desc_act", False)),
    )  # fmt: skip


def _parse_awq(q: dict[str, Any]) -> IntQuantConfig:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ 4 bits is")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", q.get("version"), "only the AWQ GEMM layout is")
    if not q.get("zero_point", True):
        raise _refuse("zero_point", q.get("zero_point"), "AWQ with zero points is")
    group = _group_size("group_size", q.get("group_size", q.get("q_group_size", 128)))
    return IntQuantConfig("awq", 4, group, sym=False)


def _parse_fp8(q: dict[str, Any]) -> Fp8QuantConfig:
    """vLLM-style FP8: per-tensor weight scales, dynamic or static activations."""
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse("activation_scheme", scheme, "dynamic and static are")
    if q.get("weight_block_size") is not None:
        raise _refuse("weight_block_size", q.get("weight_block_size"),
                      "per-tensor and per-channel scales are, block-wise is not")  # fmt: skip
    if str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise _refuse("fmt", q.get("fmt"), "e4m3 weights are")
    ignored = [m for m in q.get("ignored_layers") or [] if m != "lm_head"]
    if ignored:
        raise _refuse("ignored_layers", ignored, "only lm_head may stay unquantized")
    return Fp8QuantConfig(activation=scheme, source="fp8")


def _check_float8(prefix: str, args: dict[str, Any], strategies: tuple[str, ...]) -> str:
    """An e4m3 scheme of compressed-tensors (`weights` or `input_activations`): returns its
    strategy."""
    want = {"type": "float", "num_bits": 8, "symmetric": True}
    for key, value in want.items():
        if args.get(key, value) != value:
            raise _refuse(f"{prefix}.{key}", args.get(key), f"{value!r} is")
    strategy = args.get("strategy")
    if strategy not in strategies:
        raise _refuse(f"{prefix}.strategy", strategy, " and ".join(strategies) + " are")
    return str(strategy)


def _parse_float_quantized(q: dict[str, Any], name: str, scheme: dict[str, Any]
                           ) -> Fp8QuantConfig:  # fmt: skip
    """compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC and FP8 schemes)."""
    prefix = f"config_groups.{name}"
    w = scheme.get("weights") or {}
    _check_float8(f"{prefix}.weights", w, ("tensor", "channel"))
    if w.get("dynamic", False):
        raise _refuse(f"{prefix}.weights.dynamic", True, "static weight scales are")
    if scheme.get("output_activations") is not None:
        raise _refuse(f"{prefix}.output_activations", scheme.get("output_activations"),
                      "none is")  # fmt: skip
    a = scheme.get("input_activations")
    if a is None:
        raise _refuse(f"{prefix}.input_activations", None, "FP8 activations (W8A8) are")
    strategy = _check_float8(f"{prefix}.input_activations", a, ("token", "tensor"))
    dynamic = bool(a.get("dynamic", False))
    if dynamic != (strategy == "token"):
        raise _refuse(f"{prefix}.input_activations.dynamic", a.get("dynamic"),
                      "dynamic per-token or static per-tensor activations are")  # fmt: skip
    return Fp8QuantConfig(activation="dynamic" if dynamic else "static",
                          source="compressed-tensors")  # fmt: skip


def _parse_compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    fmt = q.get("format")
    if fmt not in ("pack-quantized", "float-quantized"):
        raise _refuse("format", fmt, "'pack-quantized' and 'float-quantized' are")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one scheme is")
    (name, scheme), = groups.items()
    prefix = f"config_groups.{name}"
    targets = scheme.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{prefix}.targets", targets, "only ['Linear'] is")
    group_fmt = scheme.get("format")
    if group_fmt not in (None, fmt):
        raise _refuse(f"{prefix}.format", group_fmt, f"only {fmt!r} (the checkpoint's) is")
    ignore = [m for m in q.get("ignore") or [] if m != "lm_head"]
    if ignore:
        raise _refuse("ignore", ignore, "only lm_head may stay unquantized")
    if fmt == "float-quantized":
        return _parse_float_quantized(q, name, scheme)
    for act in ("input_activations", "output_activations"):
        if scheme.get(act) is not None:
            raise _refuse(f"{prefix}.{act}", scheme.get(act), "weight-only schemes are")
    w = scheme.get("weights") or {}
    checks = {"type": ("int", "integer weights are"), "symmetric": (True, "symmetric weights are"),
              "dynamic": (False, "static weight scales are")}  # fmt: skip
    for key, (want, served) in checks.items():
        if w.get(key, want) != want:
            raise _refuse(f"{prefix}.weights.{key}", w.get(key), served)
    bits = w.get("num_bits")
    if bits not in (4, 8):
        raise _refuse(f"{prefix}.weights.num_bits", bits, "4 and 8 are")
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise _refuse(f"{prefix}.weights.actorder", w.get("actorder"), "none or static is")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = _group_size(f"{prefix}.weights.group_size", w.get("group_size"))
    else:
        raise _refuse(f"{prefix}.weights.strategy", strategy, "group and channel are")
    return IntQuantConfig("compressed-tensors", int(bits), group, sym=True)


_PARSERS = {
    "gptq": _parse_gptq,
    "awq": _parse_awq,
    "compressed-tensors": _parse_compressed_tensors,
    "fp8": _parse_fp8,
}

# Quantized at load from a 16-bit checkpoint: `quantization="fp8"` without a
# quantization_config.
ONLINE_FP8 = Fp8QuantConfig(activation="dynamic", source="online")


def parse_quant_config(raw: dict[str, Any], requested: str | None = None) -> QuantConfig | None:
    """The format of an HF config dict (`raw`: config.json), or None for a 16-bit checkpoint.

    requested: the engine's `quantization=`; it must name the checkpoint's own method."""
    q = raw.get("quantization_config") or raw.get("compression_config")
    if requested in ("none", ""):
        requested = None
    if requested is not None and requested not in QUANT_METHODS:
        served = ", ".join(QUANT_METHODS)
        raise ValueError(f"quantization={requested!r} is not supported ({served} are)")
    if not q:
        if requested == "fp8":
            return ONLINE_FP8
        if requested is not None:
            raise ValueError(
                f"quantization={requested!r} was asked for, but config.json has no "
                "quantization_config (only fp8 is quantized from a 16-bit checkpoint at load)"
            )
        return None
    method = str(q.get("quant_method", "")).lower()
    parser = _PARSERS.get(method)
    if parser is None:
        raise _refuse("quant_method", q.get("quant_method"), ", ".join(QUANT_METHODS) + " are")
    qc = parser(q)
    if requested is not None and requested not in (method, qc.method):
        raise ValueError(
            f"quantization={requested!r} was asked for, but the checkpoint is {method!r}"
        )
    return qc
