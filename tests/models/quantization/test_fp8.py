"""FP8 e4m3 weights, as each tool writes them and quantized at load: weight-only (W8A16)
logits and greedy tokens equal HF running the dequantized weights; W8A8 (activations rounded
to e4m3 per token, or with a static scale) stays within a bound of them; broken checkpoints
fail naming the tensor; shards hold their slice; the plan kinds agree with their reference."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import LLM, SamplingParams
from asyncengine_kernels.fp8_linear import Fp8GemmConfig, Fp8GemvConfig, fp8_dense_weight
from asyncengine_kernels.rms_norm import fused_add_rms_norm_ref
from models.config import ModelConfig
from models.layers import LinearBase
from models.loader import load_model
from models.matmul_plan import InputTransform, MatmulPlan, PlanEntry
from models.quantization import fp8
from models.quantization.fp8 import (
    Fp8DequantMatmul,
    Fp8Gemv,
    Fp8ScaledMM,
    Fp8TritonGemm,
    fp8_entry,
)
from models.quantization.kinds import agrees_with_reference
from tests.asyncengine.engine_helpers import hf_greedy
from tests.models.quantization.test_layer import as_rank
from tests.models.test_llama import assert_close_rel, flat_forward, hf_logits
from tests.quant_writers import Scheme

Make = Callable[[Scheme], tuple[Path, Path]]

SCHEMES = [
    Scheme("ct-fp8", fp8_weights="channel", activation="dynamic"),
    Scheme("ct-fp8", fp8_weights="tensor", activation="static"),
    Scheme("fp8", fp8_weights="tensor", activation="dynamic"),
    Scheme("fp8", fp8_weights="tensor", activation="static"),
    Scheme("fp8-online"),
]
PROMPTS = [[5, 9, 33, 2, 7, 100, 3], [17], list(range(40, 80))]


def _requested(scheme: Scheme) -> str | None:
    return "fp8" if scheme.method == "fp8-online" else None


def _load(model_dir: Path, quantization: str | None = None) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(model_dir, quantization)
    return load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))


def _weight_only(module: torch.nn.Module) -> MatmulPlan:
    """The W8A16 reference for FP8 layers; the 16-bit plan for the rest (the LM head)."""
    if getattr(module, "quant_config", None) is None:
        return MatmulPlan.default(module.input_transform)
    return MatmulPlan((PlanEntry(Fp8DequantMatmul(False), input=module.input_transform),))


def _set_plans(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.set_plan(_weight_only(m))


def _flat_forward(qdir: Path, scheme: Scheme, weight_only: bool) -> list[torch.Tensor]:
    plan_for = _weight_only if weight_only else None
    if scheme.method != "fp8-online":
        return flat_forward(qdir, PROMPTS, plan_for)
    # flat_forward reads config.json only; the online scheme is asked for by name.
    real = ModelConfig.from_dir

    def from_dir(d: Path, quantization: str | None = None) -> ModelConfig:
        return real(d, quantization or "fp8")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelConfig, "from_dir", from_dir)
        return flat_forward(qdir, PROMPTS, plan_for)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_weight_only_logits_equal_hf_on_dequantized_weights(quantized: Make,
                                                            scheme: Scheme) -> None:  # fmt: skip
    qdir, oracle = quantized(scheme)
    ours = _flat_forward(qdir, scheme, weight_only=True)
    for p, logits in zip(PROMPTS, ours, strict=True):
        assert_close_rel(logits, hf_logits(oracle, p))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_w8a8_logits_stay_close_to_hf(quantized: Make, scheme: Scheme) -> None:
    """Rounding each activation to e4m3 (a relative error of at most 2^-4) moves the tiny
    random model's logits, which are close together, by a few percent of their range: never
    more than 10 %, and the greedy choice stays the same at most positions."""
    qdir, oracle = quantized(scheme)
    ours = _flat_forward(qdir, scheme, weight_only=False)
    worst = 0.0
    for p, logits in zip(PROMPTS, ours, strict=True):
        want = hf_logits(oracle, p)
        worst = max(worst, float((logits - want).abs().max() / want.abs().max()))
        agree = (logits.argmax(-1) == want.argmax(-1)).float().mean()
        assert agree >= 0.8, f"greedy choice agrees on {agree:.0%} of positions"
    assert 0 < worst <= 0.10, f"relative error {worst:.3g}"


@pytest.mark.parametrize(
    "scheme", [Scheme("ct-fp8"), Scheme("fp8", fp8_weights="tensor", activation="static"),
               Scheme("fp8-online")], ids=lambda s: s.name,
)  # fmt: skip
def test_engine_weight_only_greedy_equals_hf_token_for_token(quantized: Make,
                                                             scheme: Scheme) -> None:  # fmt: skip
    qdir, oracle = quantized(scheme)
    llm = LLM(str(qdir), dtype="float32", device="cpu", num_kv_blocks=32,
              quantization=_requested(scheme))  # fmt: skip
    try:
        _set_plans(llm.llm_engine.runner.model)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(oracle, PROMPTS[:2], 16)


def test_online_quantization_is_per_output_channel(tiny_src: Path) -> None:
    src = load_file(str(tiny_src / "model.safetensors"))
    model = _load(tiny_src, "fp8")
    layer = model.model.layers[0].mlp.down_proj
    w = src["model.layers.0.mlp.down_proj.weight"].float()
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scales.shape == (w.shape[0],)
    torch.testing.assert_close(layer.scales, w.abs().amax(1) / 448)
    rel = (fp8_dense_weight(layer.qweight, layer.scales, torch.float32) - w).abs()
    assert float((rel / w.abs().amax(1, keepdim=True)).max()) <= 2.0**-4
    # Embeddings and the LM head stay 16-bit.
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert getattr(model.lm_head, "quant_config", None) is None


def test_dummy_weights_are_finite_e4m3_of_the_16_bit_dummys_size(tiny_src: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_src, "fp8")
    model = load_model(tiny_src, cfg, dtype=torch.float32, device=torch.device("cpu"),
                       load_format="dummy")  # fmt: skip
    layer = model.model.layers[0].self_attn.qkv_proj
    w = fp8_dense_weight(layer.qweight, layer.scales, torch.float32)
    assert layer.qweight.dtype == torch.float8_e4m3fn and bool(torch.isfinite(w).all())
    assert 0.01 < float(w.abs().max()) <= 0.02 and float(w.std()) > 0.005


def test_fused_shards_with_different_per_tensor_scales_keep_each_scale(quantized: Make) -> None:
    qdir, _ = quantized(Scheme("fp8", fp8_weights="tensor", activation="static"))
    tensors = load_file(str(qdir / "model.safetensors"))
    layer = _load(qdir).model.layers[1].self_attn.qkv_proj
    p = "model.layers.1.self_attn."
    want = torch.cat([tensors[p + f"{s}_proj.weight_scale"].reshape(1).expand(n)
                      for s, n in (("q", 64), ("k", 32), ("v", 32))])  # fmt: skip
    assert len(set(want.tolist())) == 3
    torch.testing.assert_close(layer.scales, want)
    # The three shards quantize one input: the largest static scale serves them.
    assert float(layer.input_scale) == max(float(tensors[p + f"{s}_proj.input_scale"])
                                           for s in "qkv")  # fmt: skip


def _rewrite(qdir: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qdir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"))
    return bad


P = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(
    ("scheme", "edit", "message"),
    [
        (Scheme("ct-fp8"), lambda t: t.pop(P + ".weight_scale"),
         f"missing {P}.weight_scale"),
        (Scheme("fp8", fp8_weights="tensor", activation="static"),
         lambda t: t.pop(P + ".input_scale"), f"missing {P}.input_scale"),
        (Scheme("ct-fp8"), lambda t: t.update({P + ".weight_scale": torch.ones(3, 1)}),
         rf"{P}.weight_scale has shape \(3, 1\)"),
        (Scheme("ct-fp8"), lambda t: t.update({P + ".weight_scale": torch.ones(64, 2)}),
         rf"{P}.weight_scale has shape \(64, 2\)"),
        (Scheme("fp8", fp8_weights="tensor", activation="static"),
         lambda t: t.update({P + ".input_scale": torch.ones(4)}),
         rf"{P}.input_scale has shape \(4,\)"),
        (Scheme("ct-fp8"), lambda t: t.update({P + ".weight_scale": -torch.ones(64, 1)}),
         f"{P}.weight_scale holds a scale that is not a positive"),
        (Scheme("ct-fp8"),
         lambda t: t.update({P + ".weight": t[P + ".weight"].float().to(torch.float8_e5m2)}),
         f"{P}.weight is torch.float8_e5m2; only e4m3"),
        (Scheme("ct-fp8"), lambda t: t.update({P + ".weight": t[P + ".weight"].float()}),
         f"{P}.weight is stored unquantized"),
        (Scheme("ct-fp8"), lambda t: t.update({P + ".weight_zero_point": torch.zeros(64, 1)}),
         "asymmetric fp8"),
        (Scheme("ct-fp8"), lambda t: t.pop(P + ".weight"), f"missing {P}.weight"),
    ],
    ids=["no-weight-scale", "no-input-scale", "scale-rows", "scale-cols", "input-scale-shape",
         "negative-scale", "e5m2", "unquantized", "zero-point", "no-weight"],
)  # fmt: skip
def test_broken_checkpoints_fail_naming_the_tensor(
    quantized: Make, tmp_path: Path, scheme: Scheme,
    edit: Callable[[dict[str, torch.Tensor]], None], message: str,
) -> None:  # fmt: skip
    qdir, _ = quantized(scheme)
    bad = _rewrite(qdir, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        _load(bad)


def test_an_inverted_scale_convention_is_far_from_the_oracle(quantized: Make) -> None:
    qdir, oracle = quantized(Scheme("ct-fp8", mistake="fp8_inverse"))
    ours = flat_forward(qdir, PROMPTS[:1], _weight_only)[0]
    want = hf_logits(oracle, PROMPTS[0])
    assert float((ours - want).abs().max() / want.abs().max()) > 0.5
    gc.collect()


@pytest.mark.parametrize(
    "scheme", [Scheme("ct-fp8", fp8_weights="tensor", activation="static"), Scheme("fp8-online")],
    ids=lambda s: s.name,
)  # fmt: skip
def test_each_rank_holds_its_rows_and_the_replicated_scales(quantized: Make,
                                                            scheme: Scheme) -> None:  # fmt: skip
    """Online, too: each projection is quantized whole, before it is split, so the ranks'
    weights and scales are those of one GPU."""
    qdir, _ = quantized(scheme)
    full = _load(qdir, _requested(scheme)).model.layers[1]
    for r in range(2):
        with as_rank(r, 2):
            part = _load(qdir, _requested(scheme)).model.layers[1]
        for name, dim in [("self_attn.o_proj", 1), ("mlp.gate_up_proj", 0), ("mlp.down_proj", 1)]:
            f, g = full.get_submodule(name), part.get_submodule(name)
            want = fp8_dense_weight(f.qweight, f.scales, torch.float32)
            got = fp8_dense_weight(g.qweight, g.scales, torch.float32)
            if f.input_scale is not None:
                assert float(g.input_scale) == float(f.input_scale)
            if dim == 1:  # row-parallel: a slice of the inputs, every channel's scale
                k = got.shape[1]
                torch.testing.assert_close(got, want[:, r * k : (r + 1) * k])
                torch.testing.assert_close(g.scales, f.scales)
            else:
                half, n = want.shape[0] // 2, got.shape[0] // 2
                gate, up = want[r * n : (r + 1) * n], want[half + r * n : half + (r + 1) * n]
                torch.testing.assert_close(got, torch.cat([gate, up]))


@pytest.mark.parametrize(
    "scheme", [Scheme("fp8", fp8_weights="tensor", activation="static"),
               Scheme("ct-fp8", fp8_weights="channel", activation="static")],
    ids=lambda s: s.name,
)  # fmt: skip
def test_gloo_tp2_serves_fp8_as_tp1(quantized: Make, scheme: Scheme) -> None:
    """W8A8 with static activation scales: the same numbers on one rank or two. (Dynamic
    per-token scales of a row-parallel layer are taken over each rank's part of the row, as
    vLLM does, so they round differently from one GPU's; the weights are the same, above.)"""
    qdir, _ = quantized(scheme)
    prompts = [[5, 9, 33, 2, 7, 100, 3], [17], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(tp: int) -> list[list[int]]:
        llm = LLM(str(qdir), dtype="float32", device="cpu", num_kv_blocks=32,
                  tensor_parallel_size=tp, quantization=_requested(scheme))  # fmt: skip
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    assert generate(2) == generate(1)


def test_a_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_src: Path) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cfg = ModelConfig.from_dir(tiny_src, "fp8")
    with pytest.raises(ValueError, match=r"FP8 tensor cores .*NVIDIA A100 has 8\.0"):
        load_model(tiny_src, cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    fp8.check_fp8_device(torch.device("cuda"))  # Ada and newer pass
    fp8.check_fp8_device(torch.device("cpu"))  # the CPU reference always serves


# ------------------------------------------------------------------------------ kinds
def _layers(quantized: Make) -> dict[str, torch.nn.Module]:
    qdir, _ = quantized(Scheme("ct-fp8"))
    layers = _load(qdir).model.layers[0]
    return {"qkv": layers.self_attn.qkv_proj, "gate_up": layers.mlp.gate_up_proj,
            "down": layers.mlp.down_proj, "norm": layers.input_layernorm}  # fmt: skip


def test_the_kinds_agree_with_their_reference(quantized: Make) -> None:
    layer = _layers(quantized)["down"]
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(0))
    static_dir, _ = quantized(Scheme("fp8", fp8_weights="tensor", activation="static"))
    static = _load(static_dir).model.layers[0].mlp.down_proj
    assert static.input_scale is not None
    assert agrees_with_reference(Fp8TritonGemm(Fp8GemmConfig(16, 32, 32, 4, 1)), static, x, None)
    assert agrees_with_reference(Fp8TritonGemm(Fp8GemmConfig(16, 32, 32, 4, 1)), layer, x, None)
    assert agrees_with_reference(Fp8Gemv(Fp8GemvConfig(16, 32)), layer, x, None)
    assert agrees_with_reference(Fp8ScaledMM(), layer, x.bfloat16(), None)
    # The weight-only GEMV is not the W8A8 product: it is checked against its own reference.
    w8a8 = Fp8DequantMatmul(True).apply(layer, x, None)
    w8a16 = Fp8DequantMatmul(False).apply(layer, x, None)
    assert not torch.equal(w8a8, w8a16)
    torch.testing.assert_close(Fp8Gemv(Fp8GemvConfig(16, 32)).apply(layer, x, None), w8a16)


def test_one_row_is_timed_with_the_norm_fused_and_as_a_kernel_of_its_own(quantized: Make
                                                                         ) -> None:  # fmt: skip
    """At one row a kind forming the RMSNorm itself (the whole-row GEMV) and the plain GEMV
    after a norm kernel are both timed, by the rules and in the full sweep; the GEMVs serve
    up to 16 rows, the whole-row one a single row."""
    gate_up = _layers(quantized)["gate_up"]
    assert gate_up.input_transform is InputTransform.RMS_NORM
    for one in (fp8.tuning_kinds(gate_up, 1), fp8.all_fp8_kinds(gate_up, 1)):
        fused = [k for k in one if InputTransform.RMS_NORM in k.fusable_inputs]
        assert any(isinstance(k, fp8.Fp8WholeRowGemv) for k in fused)
        assert any(isinstance(k, Fp8Gemv) for k in one)
    assert not any(isinstance(k, fp8.Fp8WholeRowGemv) for k in fp8.all_fp8_kinds(gate_up, 2))
    assert not any(isinstance(k, Fp8Gemv) for k in fp8.all_fp8_kinds(gate_up, 17))


def test_w8a8_kinds_form_a_normed_or_gated_input_themselves(quantized: Make) -> None:
    layers = _layers(quantized)
    gen = torch.Generator().manual_seed(1)
    gemm = Fp8TritonGemm(Fp8GemmConfig(16, 32, 32, 4, 1))
    qkv, norm, down = layers["qkv"], layers["norm"], layers["down"]
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    qkv.set_plan(MatmulPlan((fp8_entry(gemm, None, InputTransform.RMS_NORM),)))
    assert qkv.plan.entries[0].fuse_input
    got, new_residual = qkv.forward_normed(x, residual, norm)
    h, want_residual = fused_add_rms_norm_ref(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(new_residual, want_residual)
    torch.testing.assert_close(got, Fp8DequantMatmul().apply(qkv, h, None), atol=1e-4, rtol=1e-4)
    # One row on the weight-only GEMV, which cannot form the norm: the plan runs it first.
    row = fp8_entry(Fp8Gemv(Fp8GemvConfig(8, 32)), 1, InputTransform.RMS_NORM)
    qkv.set_plan(MatmulPlan((row, fp8_entry(gemm, None, InputTransform.RMS_NORM))))
    assert not qkv.plan.entries[0].fuse_input
    got, new_residual = qkv.forward_normed(x[:1], residual[:1], norm)
    torch.testing.assert_close(new_residual, want_residual[:1])
    torch.testing.assert_close(got, Fp8DequantMatmul(False).apply(qkv, h[:1], None),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    gated = torch.randn(5, 2 * down.in_features, generator=gen)
    down.set_plan(MatmulPlan((fp8_entry(gemm, None, InputTransform.SILU_AND_MUL),)))
    want = MatmulPlan((PlanEntry(Fp8DequantMatmul(), input=InputTransform.SILU_AND_MUL),))
    torch.testing.assert_close(down(gated), want.apply(down, gated, None), atol=1e-4, rtol=1e-4)
    # The weight-only GEMV takes the [gate, up] input too.
    gemv = fp8_entry(Fp8Gemv(Fp8GemvConfig(16, 32)), 16, InputTransform.SILU_AND_MUL)
    down.set_plan(MatmulPlan((gemv, fp8_entry(gemm, None, InputTransform.SILU_AND_MUL))))
    assert down.plan.entries[0].fuse_input
    want = MatmulPlan((PlanEntry(Fp8DequantMatmul(False), input=InputTransform.SILU_AND_MUL),))
    torch.testing.assert_close(down(gated), want.apply(down, gated, None), atol=1e-4, rtol=1e-4)


def test_the_whole_row_gemv_forms_a_normed_or_gated_row_itself(quantized: Make) -> None:
    """`Fp8WholeRowGemv`: one row on `asyncengine_kernels.gemv`'s persistent form over the e4m3
    rows, timed at one row where the row fits, equal to the weight-only reference with the norm
    or the activation formed in the kernel."""
    from asyncengine_kernels.gemv import TiledGemvConfig, WholeRowGemvConfig

    layers = _layers(quantized)
    qkv, norm, down = layers["qkv"], layers["norm"], layers["down"]
    whole = fp8.Fp8WholeRowGemv(WholeRowGemvConfig(2, 4, 1, 2))
    assert InputTransform.RMS_NORM in whole.fusable_inputs
    assert any(isinstance(k, fp8.Fp8WholeRowGemv) for k in fp8.tuning_kinds(qkv, 1))
    assert not any(isinstance(k, fp8.Fp8WholeRowGemv) for k in fp8.tuning_kinds(qkv, 2))
    with pytest.raises(ValueError, match="whole-row config"):
        fp8.Fp8WholeRowGemv(TiledGemvConfig(8, 32, 4, 1))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
    assert agrees_with_reference(whole, qkv, x, None)
    qkv.set_plan(MatmulPlan((fp8_entry(whole, 1, InputTransform.RMS_NORM),
                             fp8_entry(Fp8DequantMatmul(False), None,
                                       InputTransform.RMS_NORM))))  # fmt: skip
    assert qkv.plan.entries[0].fuse_input
    got, new_residual = qkv.forward_normed(x, residual, norm)
    h, want_residual = fused_add_rms_norm_ref(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(new_residual, want_residual)
    torch.testing.assert_close(got, Fp8DequantMatmul(False).apply(qkv, h, None),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    gated = torch.randn(1, 2 * down.in_features, generator=gen)
    down.set_plan(MatmulPlan((fp8_entry(whole, 1, InputTransform.SILU_AND_MUL),
                              fp8_entry(Fp8DequantMatmul(False), None,
                                        InputTransform.SILU_AND_MUL))))  # fmt: skip
    assert down.plan.entries[0].fuse_input
    want = MatmulPlan((PlanEntry(Fp8DequantMatmul(False), input=InputTransform.SILU_AND_MUL),))
    torch.testing.assert_close(down(gated), want.apply(down, gated, None), atol=1e-4, rtol=1e-4)


def test_the_rule_table_names_a_few_kinds_per_row_range(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:  # fmt: skip
    """A Llama-2-7B shape: the winners of a full-sweep start per row range, within the full
    sweep, which `ASYNCENGINE_TUNE_ALL_KINDS=1` restores; `_scaled_mm` gives way to the
    Triton GEMM where its alignment rules fail, the whole-row GEMV where the row is too
    long."""
    from types import SimpleNamespace

    monkeypatch.delenv("ASYNCENGINE_TUNE_ALL_KINDS", raising=False)

    def names(layer: SimpleNamespace, rows: int) -> list[str]:
        return [k.describe().removeprefix("fp8 ") for k in fp8.tuning_kinds(layer, rows)]

    qkv = SimpleNamespace(in_features=4096, out_features=12288)
    whole = "Triton whole-row GEMV (W8A16) whole_row[2, 8, 4, 3] pairs"
    gemv1 = "Triton GEMV (W8A16) gemv n8 k1024 split1 w4 s3"
    gemv = "Triton GEMV (W8A16) gemv n32 k256 split1 w4 s4"
    small, large = "Triton GEMM gemm 16x64x128 w4 s4", "Triton GEMM gemm 64x64x128 w4 s4"
    assert {rows: names(qkv, rows) for rows in (1, 2, 4, 8, 16, 64, 256, 1024)} == {
        1: [whole, gemv1], 2: [gemv, small, large], 4: [gemv, small, large],
        8: [gemv, small, large], 16: [gemv, "_scaled_mm", small, large],
        64: ["_scaled_mm", large], 256: ["_scaled_mm"], 1024: ["_scaled_mm"],
    }  # fmt: skip
    for layer in (qkv, SimpleNamespace(in_features=14336, out_features=4096)):
        for rows in (1, 2, 4, 8, 16, 64, 256, 1024):
            assert set(fp8.tuning_kinds(layer, rows)) <= set(fp8.all_fp8_kinds(layer, rows))
    odd = SimpleNamespace(in_features=32768, out_features=4104)  # neither fits
    assert names(odd, 1) == [gemv1]
    assert names(odd, 64) == names(odd, 1024) == [large]
    monkeypatch.setenv("ASYNCENGINE_TUNE_ALL_KINDS", "1")
    assert fp8.tuning_kinds(qkv, 1) == fp8.all_fp8_kinds(qkv, 1)
    assert len(fp8.tuning_kinds(qkv, 1)) == 28 and len(fp8.tuning_kinds(qkv, 64)) == 9


def test_rows_too_long_for_float32_get_the_whole_row_gemv_in_pairs() -> None:
    """A down projection's 11,008-long rows exceed what the float32 whole-row form holds in
    registers, not what its pairs form holds: only the pairs configs are timed there."""
    from types import SimpleNamespace

    def whole_row(in_features: int) -> list[fp8.Fp8WholeRowGemv]:
        layer = SimpleNamespace(in_features=in_features)
        return [k for k in fp8.all_fp8_kinds(layer, 1) if isinstance(k, fp8.Fp8WholeRowGemv)]

    assert {k.config.pairs for k in whole_row(4096)} == {False, True}
    assert {k.config.pairs for k in whole_row(11008)} == {True}
    assert whole_row(32768) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "scheme", [Scheme("ct-fp8"), Scheme("fp8", fp8_weights="tensor", activation="static"),
               Scheme("fp8-online")], ids=lambda s: s.name,
)  # fmt: skip
def test_gpu_engine_serves_fp8(quantized: Make, scheme: Scheme) -> None:
    """bf16 on the GPU, tuned plans and CUDA graphs: every linear layer runs an FP8 kind, and
    the first greedy token of each prompt is HF's on the dequantized weights or one whose HF
    logit is within the W8A8 bound of the CPU test (10 % of the logits' range: the tiny
    random model's logits are close together)."""
    qdir, oracle = quantized(scheme)
    prompts = [[5, 9, 33, 2, 7, 100, 3], list(range(40, 80)), [17, 18]]
    llm = LLM(str(qdir), dtype="bfloat16", device="cuda", max_num_seqs=4,
              quantization=_requested(scheme))  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        firsts = [o.outputs[0].token_ids[0] for o in outs]
        kinds = {e.kind.name for m in llm.llm_engine.runner.model.modules()
                 if getattr(m, "quant_config", None) for e in m.plan.entries}  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert kinds and all(k.startswith("fp8") for k in kinds)
    for prompt, token in zip(prompts, firsts, strict=True):
        logits = hf_logits(oracle, prompt)[-1]
        margin = 0.10 * float(logits.abs().max())
        assert float(logits[token]) >= float(logits.max()) - margin, (token, int(logits.argmax()))
