"""On a GPU: greedy engine output equals HF transformers token for token, with chunked prefill,
prefix-cache hits and preemption in one batch, both eagerly and with CUDA graphs; parallel
samples (n > 1) share their prompt's blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.model_runner import ModelRunner
from tests.asyncengine.engine_helpers import assert_pool_clean, hf_greedy
from tests.asyncengine.test_llm_engine import MAX_TOKENS, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("fused_rotary", [False, True], ids=["", "fused-decode-rotary"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_gpu_greedy_equals_hf(
    tiny_llama_dir: Path,
    enforce_eager: bool,
    preemption_mode: str,
    fused_rotary: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner's decode plans fuse rotary into split-KV attention by default; without
    # fusion the decode steps take the separate rotary/KV-write kernel.
    monkeypatch.setattr(ModelRunner, "fuse_decode_rotary", fused_rotary)
    prefix = make_prompts(452, [40], seed=11)[0]
    prompts = make_prompts(452) + [prefix + s for s in make_prompts(452, [2, 7, 30], seed=12)]
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cuda",
        num_kv_blocks=16,
        schedule_conservativeness=0,
        max_num_batched_tokens=23,
        preemption_mode=preemption_mode,
        enforce_eager=enforce_eager,
        max_num_seqs=8,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    assert ours == hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.prefix_hits > 0
    if not enforce_eager:
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        # Every prefill and mixed step here fits a prefill graph (at most 23 tokens).
        assert engine.runner.prefill_graphs is not None
        assert engine.runner.prefill_graphs.replays > 0
    assert_pool_clean(llm)


def test_gpu_bf16_matches_hf_mostly(tiny_llama_dir: Path) -> None:
    """bf16 rounding differs between implementations; the first tokens must still agree."""
    prompts = make_prompts(452, [9, 33, 64], seed=4)
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", device="cuda", max_num_seqs=4)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    ref = hf_greedy(tiny_llama_dir, prompts, 4)
    agree = sum(o.outputs[0].token_ids[0] == r[0] for o, r in zip(outs, ref, strict=True))
    assert agree == len(prompts)
    assert_pool_clean(llm)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_gpu_parallel_samples_share_the_prompt(
    tiny_llama_dir: Path, enforce_eager: bool, preemption_mode: str
) -> None:
    """n > 1 on the device: forks copy the shared last prompt block on the GPU (and through
    swap space), each greedy sample equals HF, seeded samples repeat run to run."""
    prompts = make_prompts(452, [5, 37, 16, 70], seed=13)

    def make_llm() -> LLM:
        return LLM(str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=16,
                   schedule_conservativeness=0, max_num_batched_tokens=64,
                   preemption_mode=preemption_mode, enforce_eager=enforce_eager, max_num_seqs=8)

    llm = make_llm()
    greedy = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    ref = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r] * 3 for r in ref]
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2]] * len(prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm)
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    runs = []
    for _ in range(2):  # fresh engines: the same schedule, no prefix-cache hits
        llm = make_llm()
        runs.append([[c.token_ids for c in o.outputs]
                     for o in llm.generate(prompts, seeded, use_tqdm=False)])
        assert_pool_clean(llm)
    assert runs[0] == runs[1]
    assert all(len({tuple(s) for s in samples}) > 1 for samples in runs[0])


def test_gpu_split_graphs_keep_greedy_output(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small decode graphs captured as a head of one layer and a tail
    (`ModelRunner.graph_head_layers`): greedy output equals HF, plain and speculating (the
    verify steps replay the split graphs too)."""
    from asyncengine.cuda_graphs import SplitGraph

    monkeypatch.setattr(ModelRunner, "graph_head_layers", 1)
    pattern = make_prompts(452, [6], seed=21)[0]
    prompts = [*make_prompts(452, [9, 33], seed=4), pattern * 5]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    # Three requests share the default five draft tokens a step, which leaves none each: the
    # cap is raised so that the verify steps run.
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "max_draft_tokens_per_step": 64}
    for spec in (None, ngram):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", max_num_seqs=8,
                  num_kv_blocks=64, speculative_config=spec)  # fmt: skip
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ours == want
        graphs = llm.llm_engine.runner.graphs
        assert graphs is not None and graphs.replays > 0
        split = [size for (size, _), g in graphs.graphs.items() if isinstance(g, SplitGraph)]
        assert split and max(split) <= 16
        if spec is not None:
            assert llm.llm_engine.spec_decoder.metrics.num_drafts > 0
        assert_pool_clean(llm)
        llm.shutdown()


def test_gpu_history_dependent_sampling_overlaps_with_the_same_tokens(
    tiny_llama_dir: Path,
) -> None:
    """Penalties, seeded sampling and min_tokens on the GPU: asynchronous scheduling (the
    token in flight taken from the device) gives the tokens of one step at a time."""
    prompts = make_prompts(452, [7, 20, 3], seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=5.0),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, frequency_penalty=1.5,
                       presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=10),
    ]  # fmt: skip
    results = {}
    for mode in (True, False):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=64,
                  max_num_seqs=8, async_scheduling=mode)  # fmt: skip
        results[mode] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
        assert_pool_clean(llm)
        llm.shutdown()
    assert results[True] == results[False]
