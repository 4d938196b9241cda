"""Speculative decoding: proposers draft k tokens, the target verifies them in one forward.

- `config`: `speculative_config` (vLLM's spelling) and its checks.
- `ngram`: prompt-lookup drafts from the request's own tokens.
- `draft_model`: drafts from a smaller model whose K/V shares the target's blocks.
- `draft_sampling`: the draft model's picks: argmax, or a sample from its q kept for verifying.
- `forced`: the tokens a request's grammar forces next (exact jump-forward).
- `rejection_sampler`: greedy and sampled verification, exact in distribution.
- `verify`: the verify step on the device and its host-side verdicts.
- `decoder`: the engine's coordinator: proposing, rollback of rejected slots, adaptivity.
- `metrics`: drafts, draft tokens and accepted tokens (vLLM's counters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncengine.block_pool import BlockPool
from asyncengine.spec_decode.config import SpeculativeConfig
from asyncengine.spec_decode.decoder import Proposer, SpecDecoder
from asyncengine.spec_decode.draft_model import DraftModelProposer, load_draft_model
from asyncengine.spec_decode.metrics import SpecDecodingMetrics
from asyncengine.spec_decode.ngram import NgramProposer

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpecDecoder",
    "SpecDecodingMetrics",
    "SpeculativeConfig",
    "build_spec_decoder",
    "load_draft_model",
]


def build_spec_decoder(
    raw: Mapping[str, Any] | SpeculativeConfig | None,
    pool: BlockPool,
    max_model_len: int,
    async_scheduling: bool,
    proposer: Proposer | None = None,
    *,
    jump_forward: bool = False,
) -> SpecDecoder:
    """The coordinator for an engine's `speculative_config` (`proposer` overrides the one
    the config names: benchmarks and tests plug in their own). A draft model's proposer
    (`DraftModelProposer`) needs the engine's KV cache, so the engine builds it and passes
    it here. `raw` None: grammar-forced drafts only (`jump_forward`)."""
    config = SpeculativeConfig.from_dict(raw) if raw is not None else None
    if config is not None and proposer is None:
        if config.method != "ngram":
            raise ValueError(f"speculative_config.method {config.method!r} needs its proposer")
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SpecDecoder(
        config, proposer, pool, max_model_len, count_empty_proposals=async_scheduling,
        jump_forward=jump_forward,
    )  # fmt: skip
