"""Builds a model and fills its weights from an HF safetensors directory, a GGUF file or
random values (`dummy`), with one clear error for each way a checkpoint can be wrong.

A quantized checkpoint (`ModelConfig.quantization`) builds its linear layers in that format,
reads its packed tensors and repacks every layer for the kernels once all weights are in,
each through its format's linear method (`models.quantization.method`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.quantization.config import QuantConfig
from models.quantization.layer import quantized_linears
from models.quantization.method import get_quant_method
from models.registry import build_model, get_model_class

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None, load_format: str = "auto") -> Path:
    """A directory with config.json: the embedded model, an HF dir, or a converted GGUF."""
    if model is None:
        from models.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ValueError(f"model path {path} is a file but not a .gguf file")
        from models.gguf import convert_gguf

        return convert_gguf(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if load_format in ("auto", "gguf") and len(ggufs) == 1:
            from models.gguf import convert_gguf

            return convert_gguf(ggufs[0])
        raise FileNotFoundError(f"no config.json in model directory {path}")
    return path


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"safetensors index names missing file(s): {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_safetensors(
    model_dir: Path, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    files = _safetensors_files(model_dir)
    for path in tqdm(
        files, desc="Loading safetensors", unit="file", disable=not progress or len(files) < 2
    ):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random values: realistic shapes and speed, meaningless text. Quantized layers
    get random integers, zero points mid-range and scales that give weights of the same
    magnitude as the 16-bit ones."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        # Drawn on the parameter's own device: filling a 7B model through the host is slow.
        if name.endswith(".weight_perm"):
            param.data.copy_(torch.arange(param.numel(), device=param.device))
        elif name.endswith(".weight_zero"):
            param.data.fill_(1 << (_owner(model, name).quant_config.bits - 1))
        elif name.endswith(".weight_scale"):
            levels = 1 << _owner(model, name).quant_config.bits
            param.data.fill_(0.04 / levels)
        elif param.dtype == torch.float8_e4m3fn:
            # e4m3 values in +-levels / 2: with the scale above, the 16-bit dummy's magnitude.
            # Drawn in float32 and converted (torch draws no fp8 values).
            levels = 1 << _owner(model, name).quant_config.bits
            drawn = torch.empty(param.shape, device=param.device).uniform_(-levels / 2, levels / 2,
                                                                           generator=gen)
            param.data.copy_(drawn)
        elif not param.dtype.is_floating_point:  # quantized values
            levels = 1 << _owner(model, name).quant_config.bits
            param.data.random_(0, levels, generator=gen)
        else:
            param.data.uniform_(-0.02, 0.02, generator=gen)


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    get_model_class(cfg.architecture)  # unsupported architectures fail before any allocation
    qc: QuantConfig | None = cfg.quantization
    if qc is not None:
        get_quant_method(qc).check_dtype(qc, dtype, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        weights = iterate_safetensors(model_dir)
        if qc is not None:
            weights = get_quant_method(qc).read_weights(weights, qc)
        model.load_weights(weights)  # type: ignore[operator]
    for layer in quantized_linears(model):
        get_quant_method(layer.quant_config).process_weights_after_loading(layer)
    model.eval()
    fmt = "" if qc is None else f", weights {qc.describe()}"
    logger.info("loaded %s (%s) on %s as %s%s", cfg.architecture, model_dir, device, dtype, fmt)
    return model
