"""Q1 for the FP8 KV cache on real weights: the embedded SmolLM2-135M with its K/V stored in
e4m3 keeps its perplexity over tests/data/eval_text.txt within a bound, with scales 1.0
(vLLM's default), with calibrated scales (per layer or per KV head on the text's first
window) and with the engine's default (per KV head on its shipped calibration text); scales
saved in a checkpoint (vLLM's `self_attn.k_scale` / `v_scale` names) load back to the same
result. Bounds sit above the increases measured in docs/quantization.md ("FP8 KV cache")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.eval_quant import (
    calibrate_kv_scales,
    perplexity,
    save_kv_scales,
)

pytestmark = pytest.mark.slow

# scale mode -> the largest perplexity increase allowed (measured: -0.74 % with 1.0,
# -0.08 % per layer, +0.16 % per KV head on the text's first window, +0.97 % per KV head on
# the calibration text shipped with the engine, its default).
BOUNDS = {"one": 0.02, "tensor": 0.01, "head": 0.01, "default": 0.02}


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_fp8_kv_perplexity_increase_is_bounded(
    q1_base: tuple[Path, list[int], float], mode: str
) -> None:
    model_dir, tokens, base_ppl = q1_base
    increase = perplexity(model_dir, tokens, kv_cache_dtype="fp8", kv_scales=mode) / base_ppl - 1
    assert abs(increase) <= BOUNDS[mode], f"fp8 KV, scales {mode}: {100 * increase:+.2f} %"


def test_calibrated_scales_saved_in_a_checkpoint_load_back(
    q1_base: tuple[Path, list[int], float], tmp_path: Path
) -> None:
    from models.config import ModelConfig
    from models.loader import load_model

    model_dir, tokens, _ = q1_base
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))
    scales = calibrate_kv_scales(model, tokens[:256], per_head=True)
    save_kv_scales(model_dir, tmp_path / "scaled", scales)
    loaded = load_model(tmp_path / "scaled", cfg, dtype=torch.float32, device=torch.device("cpu"))
    for attn, (k_scale, v_scale) in zip(loaded.attention_layers(), scales, strict=True):
        assert torch.equal(attn.k_scale, k_scale) and torch.equal(attn.v_scale, v_scale)
    from_checkpoint = perplexity(tmp_path / "scaled", tokens, kv_cache_dtype="fp8")
    calibrated = perplexity(model_dir, tokens, kv_cache_dtype="fp8", kv_scales="head")
    assert from_checkpoint == pytest.approx(calibrated, rel=1e-6)
