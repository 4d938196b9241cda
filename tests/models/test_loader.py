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


def test_kv_cache_scales_load_per_tensor_and_per_head(tmp_path: Path) -> None:
    """vLLM's `self_attn.k_scale` / `v_scale` (one value) and compressed-tensors'
    `k_proj.output_scale` / `v_proj.output_scale` (here one per KV head) reach the layers."""
    d = build_tiny_model_dir(tmp_path, "llama3", with_tokenizer=False)  # 2 KV heads
    weights = load_file(str(d / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor([0.5])
    weights["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.125, 2.0])
    weights["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([3.0, 4.0])
    save_file(weights, str(d / "model.safetensors"))
    attn0, attn1 = _load(d).attention_layers()
    assert attn0.k_scale.tolist() == [0.25, 0.25] and attn0.v_scale.tolist() == [0.5, 0.5]
    assert attn1.k_scale.tolist() == [0.125, 2.0] and attn1.v_scale.tolist() == [3.0, 4.0]
    assert attn1.k_scale.dtype == torch.float32


def test_kv_cache_scales_default_to_one(tmp_path: Path) -> None:
    d = build_tiny_model_dir(tmp_path, "llama3", with_tokenizer=False)
    for attn in _load(d).attention_layers():
        assert attn.k_scale.tolist() == [1.0, 1.0] and attn.v_scale.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad,match", [
    (torch.ones(3), r"k_scale must hold one value or one per KV head \(2\), got shape \[3\]"),
    (torch.ones(2, 1), r"k_scale must hold one value or one per KV head \(2\), got shape \[2, 1\]"),
    (torch.tensor(0.0), "k_scale must be finite and positive"),
])  # fmt: skip
def test_kv_cache_scale_of_a_wrong_shape_or_value_is_refused(
    tmp_path: Path, bad: torch.Tensor, match: str
) -> None:
    d = build_tiny_model_dir(tmp_path, "llama3", with_tokenizer=False)
    weights = load_file(str(d / "model.safetensors"))
    weights["model.layers.1.self_attn.k_scale"] = bad
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale: " + match):
        _load(d)
