"""Quantized linears shard like the 16-bit ones, along groups: each tensor-parallel rank
holds exactly its slice of the dequantized weight, and gloo TP=2 serves a GPTQ checkpoint
token for token as TP=1 does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine_kernels.quant_linear import dequantize_weight
from models.config import ModelConfig
from models.loader import load_model
from models.parallel import set_tensor_parallel
from tests.quant_writers import Scheme

Make = Callable[[Scheme], tuple[Path, Path]]


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    set_tensor_parallel(rank, size)
    try:
        yield
    finally:
        set_tensor_parallel(0, 1)


def _load(model_dir: Path) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))


def _dense(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight [N, K] in the input's own column order."""
    w = dequantize_weight(layer.qweight, layer.scales, layer.zeros, layer.quant_config.bits,
                          layer.group_size).t()  # fmt: skip
    if layer.input_perm is not None:
        w = torch.empty_like(w).index_copy_(1, layer.input_perm, w)
    return w


@pytest.mark.parametrize(
    "scheme", [Scheme("gptq", 4, 32), Scheme("gptq", 8, -1, sym=True), Scheme("awq", 4, 32),
               Scheme("compressed-tensors", 4, 32, sym=True)], ids=lambda s: s.name,
)  # fmt: skip
def test_each_rank_holds_its_slice_of_the_dequantized_weight(quantized: Make, scheme: Scheme
                                                             ) -> None:  # fmt: skip
    qdir, _ = quantized(scheme)
    full = _load(qdir).model.layers[1]
    for r in range(2):
        with as_rank(r, 2):
            part = _load(qdir).model.layers[1]
        for name, dim in [("self_attn.qkv_proj", None), ("self_attn.o_proj", 1),
                          ("mlp.gate_up_proj", 0), ("mlp.down_proj", 1)]:  # fmt: skip
            want, got = _dense(full.get_submodule(name)), _dense(part.get_submodule(name))
            if dim == 1:
                k = got.shape[1]
                torch.testing.assert_close(got, want[:, r * k : (r + 1) * k])
            elif dim == 0:  # [gate; up]: each rank takes its rows of both
                half, n = want.shape[0] // 2, got.shape[0] // 2
                gate, up = want[r * n : (r + 1) * n], want[half + r * n : half + (r + 1) * n]
                rows = torch.cat([gate, up])
                torch.testing.assert_close(got, rows)
            else:  # q (4 heads of 16) then k, v (2 heads each): one head block per rank
                q, k, v = want.split([64, 32, 32])
                rows = torch.cat([q[r * 32 : (r + 1) * 32], k[r * 16 : (r + 1) * 16],
                                  v[r * 16 : (r + 1) * 16]])  # fmt: skip
                torch.testing.assert_close(got, rows)


def test_a_shard_that_would_split_a_group_is_refused(quantized: Make) -> None:
    qdir, _ = quantized(Scheme("gptq", 4, 64))  # o_proj: 64 inputs, 32 per rank
    with as_rank(0, 2), pytest.raises(ValueError, match="shard of 32 input columns would split "
                                                        "a group of 64"):  # fmt: skip
        _load(qdir)


def test_act_order_split_along_the_input_is_refused(quantized: Make) -> None:
    qdir, _ = quantized(Scheme("gptq", 4, 32, desc_act=True))
    with as_rank(1, 2), pytest.raises(ValueError, match=r"desc_act.*cannot be split"):
        _load(qdir)


def test_gloo_tp2_serves_a_gptq_checkpoint_as_tp1(quantized: Make) -> None:
    qdir, _ = quantized(Scheme("gptq", 4, 32))
    prompts = [[5, 9, 33, 2, 7, 100, 3], [17], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(tp: int) -> list[list[int]]:
        llm = LLM(str(qdir), dtype="float32", device="cpu", num_kv_blocks=32,
                  tensor_parallel_size=tp)  # fmt: skip
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    assert generate(2) == generate(1)
