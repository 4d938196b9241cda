"""Q1 on real weights: the embedded SmolLM2-135M written in each format (round-to-nearest,
tests/quant_writers.py) keeps its perplexity over tests/data/eval_text.txt within a bound
per format (FP8 weights too, quantized at load and as a checkpoint), and a checkpoint with a
wrong zero-point convention is caught by the same measure. Bounds sit above the measured
increases in docs/quantization.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.eval_quant import perplexity
from tests.quant_writers import Scheme, write_quantized

pytestmark = pytest.mark.slow

# scheme -> the largest perplexity increase allowed (measured: docs/quantization.md).
BOUNDS = {
    Scheme("gptq", 4, 64): 0.35,
    Scheme("gptq", 8, 64, sym=True): 0.02,
    Scheme("awq", 4, 64): 0.35,
    Scheme("compressed-tensors", 4, 64, sym=True): 0.50,
}


@pytest.mark.parametrize("scheme", list(BOUNDS), ids=lambda s: s.name)
def test_perplexity_increase_is_bounded(
    q1_base: tuple[Path, list[int], float], tmp_path: Path, scheme: Scheme
) -> None:
    model_dir, tokens, base_ppl = q1_base
    write_quantized(model_dir, tmp_path / "q", scheme)
    increase = perplexity(tmp_path / "q", tokens) / base_ppl - 1
    assert increase <= BOUNDS[scheme], f"{scheme.name}: +{100 * increase:.1f} %"


def test_a_wrong_zero_point_convention_blows_up_perplexity(
    q1_base: tuple[Path, list[int], float], tmp_path: Path
) -> None:
    model_dir, tokens, base_ppl = q1_base
    write_quantized(model_dir, tmp_path / "q", Scheme("gptq", 4, 64, mistake="gptq_zero"))
    assert perplexity(tmp_path / "q", tokens) > 2 * base_ppl


# FP8 e4m3: (how it is served) -> the largest perplexity increase allowed (measured:
# docs/quantization.md). "online" is quantization="fp8" on the 16-bit model.
FP8_BOUNDS = {
    ("online", "W8A8"): 0.06,
    ("online", "W8A16"): 0.04,
    ("fp8-tensor", "W8A8"): 0.06,
}


@pytest.mark.parametrize(("source", "matmul"), list(FP8_BOUNDS), ids=lambda v: v)
def test_fp8_perplexity_increase_is_bounded(
    q1_base: tuple[Path, list[int], float], tmp_path: Path, source: str, matmul: str
) -> None:
    model_dir, tokens, base_ppl = q1_base
    if source == "online":
        path, quantization = model_dir, "fp8"
    else:
        path, quantization = tmp_path / "q", None
        write_quantized(model_dir, path, Scheme("fp8", fp8_weights="tensor"))
    ppl = perplexity(path, tokens, quantization=quantization, weight_only=matmul == "W8A16")
    increase = ppl / base_ppl - 1
    assert 0 < increase <= FP8_BOUNDS[(source, matmul)], f"+{100 * increase:.1f} %"
