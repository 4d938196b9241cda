"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened varlen batch.

`forward(input_ids[T], positions[T])` returns hidden states [T, hidden]; attention metadata
comes from `models.forward_context`. `compute_logits` runs the LM head only on the rows the
runner selects. `load_weights` maps HF tensor names onto the fused QKV and gate/up layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from models.attention import Attention, kv_scale_target
from models.config import ModelConfig
from models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from models.matmul_plan import InputTransform


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        # The input norm feeds this projection alone, which applies it (see forward_normed).
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.qkv_bias,
            input_transform=InputTransform.RMS_NORM,
            quant_config=cfg.quantization,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
            quant_config=cfg.quantization,
        )  # fmt: skip
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention over norm(hidden + residual); returns its output and the new residual."""
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = qkv.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # Rotary is applied inside the attention layer, fused with the KV-cache write.
        o = self.attn(q, k, v, positions, self.rotary_emb.cos_sin_cache)
        return self.o_proj(o), residual


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (only silu)")
        size = cfg.intermediate_size
        # SiLU-and-mul runs in no kernel of its own where the plans fuse it: the down
        # projection applies it to its [gate, up] input, or the gate/up projection to its
        # output (see models.matmul_plan).
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], cfg.mlp_bias,
            input_transform=InputTransform.RMS_NORM, glu_output=True,
            quant_config=cfg.quantization,
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            size, cfg.hidden_size, bias=cfg.mlp_bias,
            input_transform=InputTransform.SILU_AND_MUL, quant_config=cfg.quantization,
        )  # fmt: skip

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP over norm(hidden + residual); returns its output and the new residual."""
        gate_up, residual = self.gate_up_proj.forward_normed(hidden, residual, norm)
        return self.down_proj(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm is handed to the sublayer whose first projection applies it.
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.forward_head(input_ids, positions, 0)
        return self.forward_tail(positions, hidden, residual, 0)

    def forward_head(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The embedding and the first `num_layers` layers: (hidden, residual) before the
        next layer (residual None before the first)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[:num_layers]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual

    def forward_tail(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        first_layer: int,
    ) -> torch.Tensor:  # fmt: skip
        """The layers from `first_layer` on and the final norm, from `forward_head`'s state."""
        for layer in self.layers[first_layer:]:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; QKV and gate/up are fused, so HF names are remapped on load."""

    # HF name fragment -> (our fused module fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward_head(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward up to layer `num_layers` (a CUDA graph split in two: `cuda_graphs`)."""
        return self.model.forward_head(input_ids, positions, num_layers)

    def forward_tail(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        first_layer: int,
    ) -> torch.Tensor:  # fmt: skip
        """The rest of the forward from `forward_head`'s (hidden, residual)."""
        return self.model.forward_tail(positions, hidden, residual, first_layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; returns the HF names used. Unknown names raise."""
        params = dict(self.named_parameters())
        loaded_targets: set[tuple[str, object]] = set()
        used: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            kv_scale = kv_scale_target(hf_name)
            if kv_scale is not None:  # the FP8 KV cache's scales (unused by a 16-bit cache)
                attn = self.get_submodule(kv_scale[0]).attn
                try:
                    attn.load_kv_scale(kv_scale[1], tensor, self.config.num_key_value_heads)
                except ValueError as e:
                    raise ValueError(f"{hf_name}: {e}") from None
                used.add(hf_name)
                continue
            name, shard = hf_name, None
            for frag, (fused, shard_id) in self.packed_modules_mapping.items():
                if f".{frag}." in hf_name:
                    name, shard = hf_name.replace(f".{frag}.", f".{fused}."), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}"
                )
            try:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor.to(param.dtype), shard)
            except ValueError as e:
                raise ValueError(f"{hf_name}: {e}") from None
            loaded_targets.add((name, shard))
            used.add(hf_name)
        missing = [n for n in self.expected_hf_names() if n not in used]
        if missing:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        return used

    def expected_hf_names(self) -> list[str]:
        """Every HF tensor name a complete checkpoint of this config must provide."""
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(p + f"self_attn.{proj}.weight")
                if cfg.qkv_bias:
                    names.append(p + f"self_attn.{proj}.bias")
            names.append(p + "self_attn.o_proj.weight")
            if cfg.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.append(p + f"mlp.{proj}.weight")
                if cfg.mlp_bias:
                    names.append(p + f"mlp.{proj}.bias")
        return names
