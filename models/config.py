"""The architecture facts the engine needs, read from an HF `config.json` of the Llama family."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.quantization.config import QuantConfig, parse_quant_config

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "torch.float32": torch.float32,
    "torch.float16": torch.float16,
    "torch.bfloat16": torch.bfloat16,
}


# The fields no default can stand in for: without them the model has no shape.
_REQUIRED_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
)


@dataclass
class ModelConfig:
    """A normalized view of an HF config (transformers 4.x and 5.x spellings both accepted)."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype | None = None
    # The weight format of a quantized checkpoint (None: 16/32-bit weights).
    quantization: QuantConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], quantization: str | None = None) -> ModelConfig:
        """quantization: the engine's `quantization=`; it must agree with the checkpoint's
        `quantization_config`."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no 'architectures'; cannot pick a model class")
        missing = [key for key in _REQUIRED_KEYS if cfg.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(map(repr, missing))}")
        model_type = cfg.get("model_type", "")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        is_qwen2 = model_type == "qwen2" or archs[0].startswith("Qwen2")
        attn_bias = bool(cfg.get("attention_bias", False))
        use_window = cfg.get("use_sliding_window", True)
        window = cfg.get("sliding_window") if use_window else None
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            architecture=archs[0],
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=_DTYPE_NAMES.get(str(dtype_name)) if dtype_name else None,
            quantization=parse_quant_config(cfg, quantization),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data, quantization)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem
