"""Our Llama-family forward equals HF transformers' logits on the same weights (float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncengine_kernels.cpu_linear import PACKED_MAX_ROWS
from asyncengine_kernels.gemv import GemvConfig, TiledGemvConfig, WholeRowGemvConfig
from models.config import ModelConfig
from models.forward_context import AttentionMetadata, set_forward_context
from models.linear_tuning import cpu_kinds
from models.loader import load_model
from models.matmul_plan import (
    Blas,
    Epilogue,
    InputTransform,
    MatmulKind,
    MatmulPlan,
    PlanEntry,
    PlannedMatmul,
    TritonGemv,
)
from tests.tiny_models import build_tiny_model_dir

BLOCK = 16

PlanFor = Callable[[PlannedMatmul], MatmulPlan]


def batch1_gemv_plans(config: GemvConfig, fuse_inputs: bool, glu: bool) -> PlanFor:
    """Plans as if the tuner chose the Triton GEMV everywhere: the batch-1 GEMV
    (the norms and activation fused in or not), the BLAS call above; with `glu`, the gate/up
    GEMV applies SiLU-and-mul in its epilogue and the down projection takes a plain input."""

    def plan(layer: PlannedMatmul) -> MatmulPlan:
        declared = layer.input_transform
        gated = declared is InputTransform.SILU_AND_MUL
        gemv_input = InputTransform.NONE if glu and gated else declared
        fuse = fuse_inputs and gemv_input is not InputTransform.NONE
        epilogue = Epilogue.SILU_AND_MUL if glu and layer.glu_output else Epilogue.NONE
        gemv = PlanEntry(TritonGemv(config), 1, gemv_input, fuse, epilogue)
        return MatmulPlan((gemv, PlanEntry(Blas(), input=declared)))

    return plan


def small_batch_plans(kind: MatmulKind, max_rows: int) -> PlanFor:
    """`kind` for steps of up to `max_rows` rows (forming the input itself where it can),
    the BLAS call above."""

    def plan(layer: PlannedMatmul) -> MatmulPlan:
        declared = layer.input_transform
        fuse = declared in kind.fusable_inputs
        return MatmulPlan((
            PlanEntry(kind, max_rows, declared, fuse), PlanEntry(Blas(), input=declared)
        ))  # fmt: skip

    return plan


def flat_forward(
    model_dir: Path, prompts: list[list[int]], plan_for: PlanFor | None = None,
    split: int = 0,
) -> list[torch.Tensor]:  # fmt: skip
    """Run all prompts in ONE flattened varlen step through a fresh paged cache; with
    `plan_for`, every linear layer and the LM head take the plan it gives; with `split`, as
    `forward_head` over that many layers and `forward_tail` over the rest."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))
    if plan_for is not None:
        for module in model.modules():
            if isinstance(module, PlannedMatmul):
                module.set_plan(plan_for(module))
    blocks_per = [-(-len(p) // BLOCK) for p in prompts]
    num_blocks = sum(blocks_per)
    for attn in model.attention_layers():
        shape = (num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    # Hand out blocks in reverse so block tables are not the identity.
    free = list(range(num_blocks))[::-1]
    tables = [[free.pop() for _ in range(n)] for n in blocks_per]
    width = max(blocks_per)
    ids, pos, slots, qsl = [], [], [], [0]
    for p, table in zip(prompts, tables, strict=True):
        ids += p
        pos += range(len(p))
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )
    with torch.inference_mode(), set_forward_context(meta):
        ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
        if split:
            hidden = model.forward_tail(pos_t, *model.forward_head(ids_t, pos_t, split), split)
        else:
            hidden = model(ids_t, pos_t)
        logits = model.compute_logits(hidden)
    return [logits[qsl[i] : qsl[i + 1]] for i in range(len(prompts))]


def hf_logits(model_dir: Path, prompt: list[int], **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err <= tol, f"relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("kind", ["llama2", "llama3", "qwen2", "tied", "mistral"])
def test_logits_match_hf(tmp_path: Path, kind: str) -> None:
    model_dir = build_tiny_model_dir(tmp_path, kind)
    gen = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    # Lengths cross block boundaries and differ per prompt: 1, 15, 16, 17, 40 tokens.
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (17, 1, 40, 16, 15)]
    ours = flat_forward(model_dir, prompts)
    for p, logits in zip(prompts, ours, strict=True):
        assert_close_rel(logits, hf_logits(model_dir, p))


@pytest.mark.parametrize("split", [1, 2])
def test_a_forward_split_in_two_is_the_forward(tmp_path: Path, split: int) -> None:
    """Head and tail (what a split decode graph captures) give the whole forward's logits
    bit for bit, the split after the first layer or after the last."""
    model_dir = build_tiny_model_dir(tmp_path, "llama3")
    gen = torch.Generator().manual_seed(1)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 18)]
    whole = flat_forward(model_dir, prompts)
    halves = flat_forward(model_dir, prompts, split=split)
    assert all(torch.equal(a, b) for a, b in zip(whole, halves, strict=True))


@pytest.mark.parametrize(
    "config", [TiledGemvConfig(8, 16, 4, 1), WholeRowGemvConfig(2, 4, 1, 2)], ids=str
)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("fuse_inputs", [True, False])
@pytest.mark.parametrize("kind", ["llama2", "qwen2"])
def test_batch1_gemv_path_matches_hf(
    tmp_path: Path, kind: str, fuse_inputs: bool, glu: bool, config: GemvConfig
) -> None:
    """One token through the batch-1 GEMVs gives HF's logits, with the input transforms
    fused (RMSNorm in the QKV and gate/up prologues, SiLU-and-mul in the down projection) or
    run as kernels of their own, and with SiLU-and-mul in the gate/up GEMV's epilogue."""
    model_dir = build_tiny_model_dir(tmp_path, kind)
    prompt = [7]
    ours = flat_forward(model_dir, [prompt], batch1_gemv_plans(config, fuse_inputs, glu))[0]
    assert_close_rel(ours, hf_logits(model_dir, prompt))


@pytest.mark.parametrize("matmul", cpu_kinds(), ids=lambda k: k.describe())
@pytest.mark.parametrize("kind", ["llama2", "qwen2"])
def test_cpu_small_batch_plans_match_hf(tmp_path: Path, kind: str, matmul: MatmulKind) -> None:
    """Every linear layer on the oneDNN-packed weight, or on the CPU GEMM forming its input
    itself: a step within its rows (prompts of 17 and 1 tokens) and one above them (the
    BLAS entry) both give HF's logits."""
    model_dir = build_tiny_model_dir(tmp_path, kind)
    gen = torch.Generator().manual_seed(1)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    plans = small_batch_plans(matmul, PACKED_MAX_ROWS)
    for lengths in [(17, 1), (PACKED_MAX_ROWS, 5)]:
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
        for p, logits in zip(prompts, flat_forward(model_dir, prompts, plans), strict=True):
            assert_close_rel(logits, hf_logits(model_dir, p))


def test_config_reads_architecture_facts(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(build_tiny_model_dir(tmp_path / "q", "qwen2"))
    assert (cfg.architecture, cfg.qkv_bias, cfg.o_bias) == ("Qwen2ForCausalLM", True, False)
    cfg = ModelConfig.from_dir(build_tiny_model_dir(tmp_path / "l", "llama3"))
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_theta) == (4, 2, 500000.0)
