"""Each way a checkpoint can be wrong gives one clear error naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.loader import load_model, resolve_model_path
from tests.tiny_models import build_tiny_model_dir


def _load(path: Path, load_format: str = "auto") -> torch.nn.Module:
    model_dir = resolve_model_path(str(path), load_format)
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(
        model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"), load_format=load_format
    )


def test_wrong_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nope")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        _load(tmp_path)


def test_config_without_a_shape_field_names_it(tmp_path: Path) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "m", "llama3")
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_attention_heads"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json lacks 'num_attention_heads'"):
        ModelConfig.from_dir(model_dir)


def test_missing_tensor(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama2", with_tokenizer=False)
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.1\.mlp\.up_proj"):
        _load(d)


def test_shape_mismatch(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama2", with_tokenizer=False)
    weights = load_file(str(d / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj.*shape mismatch.*\(64, 32\)"):
        _load(d)


def test_unsupported_architecture(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama2", with_tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        _load(d)


def test_no_weights(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama2", with_tokenizer=False)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        _load(d)


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama3", with_tokenizer=False)
    weights = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(d / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = _load(d)
    ref = weights["model.layers.1.self_attn.k_proj.weight"]
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    q_rows = 4 * 16  # 4 query heads of head_dim 16 come first
    assert torch.equal(qkv[q_rows : q_rows + ref.shape[0]], ref)


def test_dummy_weights_fill_every_parameter(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama3", with_tokenizer=False)
    (d / "model.safetensors").unlink()  # dummy needs only config.json
    model = _load(d, "dummy")
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert p.abs().sum() > 0, name
