"""Maps an HF `architectures` name to the model class that implements it."""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig
from models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            + ", ".join(supported_architectures())
        ) from None


def build_model(cfg: ModelConfig) -> nn.Module:
    return get_model_class(cfg.architecture)(cfg)
