"""Helpers for engine tests: HF greedy references, pool-emptiness checks, a pool that must
preempt, HF models saved as checkpoints, greedy runs with and without speculation, QKV
projections planned on the few-row matmul."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncengine.llm import LLM
from asyncengine.sampling_params import SamplingParams

# Engine arguments for a pool too small for the batch, with no room kept for growth at
# admission (which would spare the running requests): the engine must preempt.
TINY_POOL = {"num_kv_blocks": 14, "schedule_conservativeness": 0}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF transformers `generate`, one prompt at a time (no padding effects), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def assert_pool_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    if engine.scheduler.swap_space is not None:
        assert engine.scheduler.swap_space.num_free_blocks == engine.scheduler.swap_space.num_blocks


def save_hf(model: torch.nn.Module, tokenizer_dir: Path | None, path: Path) -> Path:
    from transformers import AutoTokenizer

    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def greedy_plain_and_speculating(
    model_dir: Path, check: Callable[[LLM], None],
    prepare: Callable[[LLM], None] | None = None, *, device: str = "cuda",
    max_tokens: int = 24, **engine_args: Any,
) -> None:  # fmt: skip
    """Greedy output equals HF for three prompts, one of which repeats a pattern, without
    speculation and with n-gram drafts (verify steps run); `prepare` changes each engine
    before it serves, `check` looks at it after."""
    from tests.asyncengine.test_llm_engine import make_prompts

    pattern = make_prompts(452, [6], seed=21)[0]
    prompts = [*make_prompts(452, [9, 33], seed=4), pattern * 5]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = hf_greedy(model_dir, prompts, max_tokens)
    # Three requests share the default five draft tokens a step, which leaves none each: the
    # cap is raised so that the verify steps run.
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "max_draft_tokens_per_step": 64}
    for spec in (None, ngram):
        llm = LLM(str(model_dir), dtype="float32", device=device, max_num_seqs=8,
                  num_kv_blocks=64, speculative_config=spec, **engine_args)  # fmt: skip
        if prepare is not None:
            prepare(llm)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ours == want
        check(llm)
        if spec is not None:
            assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
        assert_pool_clean(llm)
        llm.shutdown()


def plan_qkv_on_few_row_matmul(llm: LLM, fuse_norm: bool) -> None:
    """Every QKV projection of `llm` on the few-row matmul up to 16 rows (64-column blocks,
    two K splits; the norm in it or before it), then the engine's serving set-up again, so
    CUDA graphs are captured with that plan."""
    from asyncengine_kernels.skinny_gemm import SkinnyConfig
    from models.layers import QKVParallelLinear
    from models.matmul_plan import Blas, InputTransform, MatmulPlan, PlanEntry, TritonSkinnyGemm

    norm = InputTransform.RMS_NORM
    plan = MatmulPlan((PlanEntry(TritonSkinnyGemm(SkinnyConfig(64, 128, 2, 4, 2)), 16, norm,
                                 fuse_input=fuse_norm), PlanEntry(Blas(), input=norm)))  # fmt: skip
    engine = llm.llm_engine
    for module in engine.runner.model.modules():
        if isinstance(module, QKVParallelLinear):
            module.set_plan(plan)
    spec = engine.spec_decoder
    engine.runner.prepare_for_serving(
        enforce_eager=False, max_num_seqs=engine.scheduler.max_num_seqs,
        max_blocks_per_seq=engine.pool.blocks_needed(engine.max_model_len),
        verify_rows=0 if spec is None else spec.max_verify_rows,
    )  # fmt: skip

