"""`kv_cache_dtype="fp8"` through the engine on the CPU path: e4m3 blocks, twice the blocks of
a 16-bit pool, outputs close to the "auto" run (scales calibrated at start-up or 1.0),
preemption (swap and recompute) unchanged, the dtype in the stats, bad values and GPUs
without FP8 refused. On a GPU (`gpu`): the Triton kernels, eager and under CUDA graphs,
against the CPU path over the same FP8 cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, EngineArgs, SamplingParams
from asyncengine.outputs import RequestOutput
from tests.asyncengine.engine_helpers import TINY_POOL, assert_pool_clean
from tests.asyncengine.test_llm_engine import make_prompts

MAX_TOKENS = 24
# Largest change of a greedy token's logprob that the FP8 cache may cause on the tiny GQA
# model, over positions whose context is still the same in both runs. Measured (6 prompts):
# 0.056 over 69 positions with scales 1.0, 0.043 over 102 with the scales calibrated at
# start-up; the model is random, so its logits are nearly flat and greedy paths part early
# (first divergence at 0-24 tokens), which is why logprobs are bounded here rather than token
# agreement (tests/asyncengine/test_kv_calibration.py bounds that).
MAX_LOGPROB_DELTA = 0.15


def _generate(model_dir: Path, prompts: list[list[int]], **engine_args: object
              ) -> tuple[LLM, list[RequestOutput]]:  # fmt: skip
    engine_args = {"dtype": "float32", "device": "cpu", **engine_args}
    llm = LLM(str(model_dir), **engine_args)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _logprob_delta(one: list[RequestOutput], other: list[RequestOutput]) -> tuple[float, int]:
    """The largest change of a greedy token's logprob between two runs, over the positions
    whose context is the same in both, and how many positions that is."""
    worst, compared = 0.0, 0
    for a, b in zip(one, other, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        # Up to and including the first differing token, both runs saw the same context:
        # the greedy token's logprob is the top of the same distribution in each.
        same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
        last = len(ta) - 1 if same is None else same
        for i in range(last + 1):
            worst = max(worst, abs(la[i][ta[i]] - lb[i][tb[i]]))
            compared += 1
    return worst, compared


@pytest.mark.parametrize("calculate_kv_scales", [None, False], ids=["calibrated", "scales-1"])
def test_fp8_cache_stays_close_to_the_16_bit_run(
    tiny_llama_dir: Path, calculate_kv_scales: bool | None
) -> None:
    prompts = make_prompts(452)
    _, auto = _generate(tiny_llama_dir, prompts)
    llm, fp8 = _generate(
        tiny_llama_dir, prompts, kv_cache_dtype="fp8", calculate_kv_scales=calculate_kv_scales
    )
    runner = llm.llm_engine.runner
    assert runner.kv_cache is not None
    assert runner.kv_cache.data.dtype == torch.float8_e4m3fn
    worst, compared = _logprob_delta(auto, fp8)
    assert compared > 2 * len(prompts)  # decode steps over the FP8 cache are compared too
    assert 0.0 < worst <= MAX_LOGPROB_DELTA


def test_fp8_pool_holds_twice_the_blocks_of_bf16(tiny_llama_dir: Path) -> None:
    def pool(kv: str) -> tuple[int, int]:
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", device="cpu", kv_cache_dtype=kv,
                  cpu_kv_cache_gib=0.01, skip_tokenizer_init=True)  # fmt: skip
        engine = llm.llm_engine
        return engine.pool.num_blocks, engine.runner.block_bytes()

    (bf16_blocks, bf16_bytes), (fp8_blocks, fp8_bytes) = pool("auto"), pool("fp8_e4m3")
    assert fp8_bytes * 2 == bf16_bytes
    assert abs(fp8_blocks - 2 * bf16_blocks) <= 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_fp8_blocks_changes_nothing(tiny_llama_dir: Path, mode: str) -> None:
    """Swapped e4m3 blocks come back byte for byte; recomputed ones are quantized again to
    the same values: the greedy outputs equal a run without preemption."""
    prompts = make_prompts(452)
    _, plain = _generate(tiny_llama_dir, prompts, kv_cache_dtype="fp8")
    llm, preempted = _generate(
        tiny_llama_dir, prompts, kv_cache_dtype="fp8", **TINY_POOL, preemption_mode=mode
    )
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0
    if mode == "swap":
        assert scheduler.num_swaps_out > 0 and scheduler.num_swaps_in > 0
        cpu_cache = llm.llm_engine.runner.cpu_cache
        assert cpu_cache is not None and cpu_cache.data.dtype == torch.float8_e4m3fn
    assert _tokens(preempted) == _tokens(plain)
    assert_pool_clean(llm)


def test_stats_show_the_kv_dtype(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_dtype="fp8",
              skip_tokenizer_init=True)  # fmt: skip
    assert llm.llm_engine.get_stats().kv_cache_dtype == "fp8_e4m3"
    auto = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", skip_tokenizer_init=True)
    assert auto.llm_engine.get_stats().kv_cache_dtype == "float32"


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", "FP8", ""])
def test_unsupported_kv_cache_dtype_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype=value)  # type: ignore[arg-type]


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute capability below 8.9 (here an A100's 8.0): a clear error at engine start,
    never a silent 16-bit cache."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    args = EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100 has 8.0"):
        args.resolve_kv_cache_dtype(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    dtype = args.resolve_kv_cache_dtype(torch.bfloat16, torch.device("cuda"))
    assert dtype == torch.float8_e4m3fn
    assert EngineArgs().resolve_kv_cache_dtype(torch.bfloat16, torch.device("cuda")) == (
        torch.bfloat16
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused_rotary", [False, True], ids=["", "fused-decode-rotary"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_fp8_cache_follows_the_cpu_path(
    tiny_llama_dir: Path, enforce_eager: bool, fused_rotary: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The Triton kernels (write, prefill, split-KV decode, fused rotary; captured in CUDA
    graphs or not) over an e4m3 cache, with chunked prefill and swaps, give the logprobs of
    the CPU reference path over the same format, and stay as close to a 16-bit cache. Both
    engines calibrate their KV scales at start-up, the GPU one through the Triton kernels."""
    from asyncengine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "fuse_decode_rotary", fused_rotary)
    prompts = make_prompts(452)
    cpu_llm, cpu = _generate(tiny_llama_dir, prompts, kv_cache_dtype="fp8")
    gpu_args = dict(device="cuda", num_kv_blocks=16, schedule_conservativeness=0,
                    max_num_batched_tokens=23, preemption_mode="swap",
                    enforce_eager=enforce_eager, max_num_seqs=8)
    llm, gpu = _generate(tiny_llama_dir, prompts, kv_cache_dtype="fp8", **gpu_args)
    engine = llm.llm_engine
    cpu_scales = cpu_llm.llm_engine.calibrated_kv_scales
    assert cpu_scales is not None and engine.calibrated_kv_scales is not None
    # Triton's float32 dots may run in TF32: the same scales up to that rounding.
    for (k, v), (k_cpu, v_cpu) in zip(engine.calibrated_kv_scales, cpu_scales, strict=True):
        torch.testing.assert_close(k, k_cpu, rtol=1e-2, atol=0)
        torch.testing.assert_close(v, v_cpu, rtol=1e-2, atol=0)
    assert engine.runner.kv_cache is not None
    assert engine.runner.kv_cache.data.dtype == torch.float8_e4m3fn
    assert engine.scheduler.num_swaps_out > 0
    if not enforce_eager:
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    # Summation order differs between the paths, and a value next to a rounding boundary
    # may take the neighbouring e4m3 code: close, not equal.
    worst, compared = _logprob_delta(cpu, gpu)
    assert compared >= len(prompts) and worst <= MAX_LOGPROB_DELTA / 3
    _, gpu_auto = _generate(tiny_llama_dir, prompts, **gpu_args)
    assert _logprob_delta(gpu_auto, gpu)[0] <= MAX_LOGPROB_DELTA
    assert_pool_clean(llm)
