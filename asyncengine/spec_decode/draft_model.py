"""The draft-model proposer: a smaller model of the target's vocabulary drafts k tokens,
with its own K/V kept in the target's KV blocks.

Every block of the pool holds the target's K/V and the draft's (the model runner's
`draft_kv_cache`: the same block ids, a second, smaller cache per draft layer), so the pool
is sized for both at start, and allocation, prefix caching, copy-on-write and preemption
serve the draft with no second pool (swap preemption moves the draft's half of a block with
the target's). `Request.num_draft_computed_tokens` counts the leading positions whose draft
K/V is in the request's blocks. It counts known tokens only, never the draft's own drafts:
whether a draft is kept is known only after verification, and its slot may be freed and
handed to another request by the rollback. The next proposal recomputes the kept drafts
together with the target's new token, in the one forward it runs anyway. The count drops to
zero when the request loses its blocks (recompute preemption, `Scheduler._preempt`); a
swapped-out request keeps it, its draft K/V coming back with its blocks. A prefix-cache hit
sets it to the hit's leading blocks that hold the draft's K/V (`BlockPool.draft_cached`,
marked here once the draft has run over a cached block), so a shared prompt's draft pass is
not run again.

Proposing, for the requests `SpecDecoder.propose` hands over: reserve the slots of the
draft tokens' K/V, run the draft over each request's tokens it has not seen (chunked to the
token budget) to get the first draft from the last position, then k - 1 one-token steps
batched over the requests, each feeding the previous step's drafts. A greedy request's
drafts are the draft's argmax (point masses); a request that samples draws its drafts from
the draft's own distribution q under its sampling parameters, and q's rows stay on the
device with the drafts (`Request.spec_draft_probs`) for the verify step, which accepts with
min(1, p/q) (`draft_sampling`, `rejection_sampler`). The drafts stay on the device until the
last step; one copy brings them to the host, and nothing before it waits for the device
(inputs go up through pinned buffers), so the host queues a proposal's forwards back to back.
On the GPU the one-token steps replay CUDA graphs of the draft (`capture_graphs`: the
target's `DecodeGraphs` over the draft model, in a memory pool of their own), one replay each
where eagerly a small model's step is paced by its few hundred kernel launches; a small step
is written straight into the graph's inputs with one copy. A short catch-up (after a verify
step: the kept drafts and the target's new token) runs as one decode row per token, as the
target's verify step does, and replays a graph too; a catch-up over a prompt runs eagerly.
Under tensor parallelism it runs whole on rank 0: it is loaded before the ranks start, so its
layers are built unsplit and need no collective.

Refused at start, naming `speculative_config.model`: a missing directory, a vocabulary other
than the target's (the config's `vocab_size`, and the tokenizers where both have one), and a
draft with more parameters than the target.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncengine.block_pool import BlockPool
from asyncengine.cuda_graphs import STAGE_MAX_ROWS, DecodeGraphs
from asyncengine.host_staging import PinnedStaging
from asyncengine.model_runner import (
    KVCache,
    StepInputs,
    one_row_per_token,
    stage_decode_rows,
    step_inputs,
    token_layout,
)
from asyncengine.request import Request
from asyncengine.sampler import host_to_device
from asyncengine.spec_decode.config import SpeculativeConfig
from asyncengine.spec_decode.draft_sampling import DraftSampling
from asyncengine.step_buffer import StepHeader, pack, unpack
from asyncengine_kernels.paged_attention import DecodePlan, decode_plan
from models.config import ModelConfig
from models.forward_context import set_forward_context
from models.loader import load_model, resolve_model_path

logger = logging.getLogger(__name__)

FIELD = "speculative_config.model"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_NONE = np.empty(0, np.int64)
# A catch-up forward whose every request has at most this many tokens to run goes as one
# decode row per token (batch expansion, as the target's verify step), so that it replays a
# decode graph: after a verify step that is the kept drafts and the target's new token. A
# longer one (a prompt the draft has not seen) runs eagerly as a prefill.
EXPAND_MAX_TOKENS = 17
# Pinned upload buffers in rotation: the host lays out up to this many of the draft's steps
# ahead of the device (`PinnedStaging`).
STAGING_TURNS = 4


def num_parameters(cfg: ModelConfig) -> int:
    """Weights of a Llama-family model of this shape: embeddings, LM head (unless tied),
    attention and MLP projections (norms and biases are too small to matter)."""
    h, d = cfg.hidden_size, cfg.head_dim
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * h * cfg.intermediate_size
    return embed + cfg.num_hidden_layers * (attn + mlp)


@dataclass
class DraftModel:
    """The loaded draft: its module, its config and where it came from."""

    model: nn.Module
    config: ModelConfig
    path: Path

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of its K/V: what a KV block holds for it."""
        attn = self.model.attention_layers()  # type: ignore[operator]
        return len(attn), attn[0].num_kv_heads, attn[0].head_dim


def check_draft_config(draft: ModelConfig, target: ModelConfig) -> None:
    """The draft must share the target's vocabulary size and be no larger than it."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FIELD} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model must share the target's vocabulary"
        )
    draft_size, target_size = num_parameters(draft), num_parameters(target)
    if draft_size > target_size:
        raise ValueError(
            f"{FIELD} is larger than the target ({draft_size / 1e6:.1f}M parameters against "
            f"{target_size / 1e6:.1f}M): a draft model must be the smaller one"
        )


def check_draft_tokenizer(path: Path, target_tokenizer: Any) -> None:
    """Where both have a tokenizer, the draft's must map the same strings to the same ids."""
    if target_tokenizer is None or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{FIELD}: cannot load the tokenizer in {path} ({e})") from e
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"{FIELD} has another tokenizer than the target ({len(draft_tokenizer)} tokens "
            f"against {len(target_tokenizer)}, or the same count with other ids): a draft "
            "model must share the target's vocabulary"
        )


def load_draft_model(
    spec: SpeculativeConfig,
    target: ModelConfig,
    target_tokenizer: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> DraftModel:
    """Check and load `spec.model` with the target's dtype and device; a bad draft raises a
    ValueError naming `speculative_config.model` before any weight is read."""
    assert spec.model is not None
    try:
        path = resolve_model_path(spec.model, spec.load_format)
        cfg = ModelConfig.from_dir(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{FIELD} {spec.model!r} cannot be used: {e}") from e
    check_draft_config(cfg, target)
    check_draft_tokenizer(path, target_tokenizer)
    try:
        model = load_model(path, cfg, dtype=dtype, device=device, load_format=spec.load_format,
                           seed=seed)  # fmt: skip
    except (OSError, ValueError) as e:
        raise ValueError(f"{FIELD} {spec.model!r} cannot be loaded: {e}") from e
    logger.info(
        "draft model %s: %d layers, %.1fM parameters (target %.1fM)", path,
        cfg.num_hidden_layers, num_parameters(cfg) / 1e6, num_parameters(target) / 1e6,
    )  # fmt: skip
    return DraftModel(model, cfg, path)


class DraftModelProposer:
    """Drafts from a draft model whose K/V lives in the target's KV blocks: argmax drafts
    for greedy requests, drafts sampled from the draft's q for requests that sample
    (`sample_drafts` False: argmax drafts for all)."""

    def __init__(
        self,
        draft: DraftModel,
        kv_cache: KVCache,
        pool: BlockPool,
        *,
        device: torch.device,
        max_num_batched_tokens: int,
        sample_drafts: bool = True,
    ) -> None:
        self.draft = draft
        self.sample_drafts = sample_drafts
        self.model = draft.model
        self.pool = pool
        self.device = device
        self.block_size = pool.block_size
        # Tokens of one catch-up forward: its activations stay within a target step's.
        self.max_num_batched_tokens = max_num_batched_tokens
        # Rotary tables end here: no draft position may pass it.
        self.max_position = draft.config.max_position_embeddings
        _, self.num_kv_heads, _ = draft.kv_layout
        for i, attn in enumerate(self.model.attention_layers()):  # type: ignore[operator]
            attn.k_cache, attn.v_cache = kv_cache.layer(i)
        # The one-token steps' CUDA graphs (`capture_graphs`); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        # Steps are uploaded without a wait, so the host queues a proposal's forwards back to
        # back and meets the device once, when the drafts come back.
        self.staging = PinnedStaging(device, turns=STAGING_TURNS)

    def capture_graphs(
        self, max_num_seqs: int, max_blocks_per_seq: int, expanded_rows: int = 0,
        head_layers: int = 0,
    ) -> None:  # fmt: skip
        """Capture the draft's one-token steps as CUDA graphs for up to `max_num_seqs`
        requests, and the plans of batch-expanded catch-ups of up to `expanded_rows` rows
        (the target's largest verify step; on the GPU, once the KV cache exists); small ones
        split after `head_layers` layers where that is not 0 (`cuda_graphs.SplitGraph`)."""
        graphs = DecodeGraphs(self.model, self.device, max_num_seqs, max_blocks_per_seq,
                              verify_rows=expanded_rows, label="draft decode",
                              head_layers=head_layers)  # fmt: skip
        graphs.capture()  # a pool of its own: the target's graphs never wait on it
        self.graphs = graphs

    def shutdown(self) -> None:
        """Let go of the draft's graphs, weights and view of the KV cache."""
        self.graphs = None
        self.staging.release()
        model, self.model = self.model, None  # type: ignore[assignment]
        if model is not None:
            for attn in model.attention_layers():  # type: ignore[operator]
                attn.k_cache = attn.v_cache = None
        self.draft = None  # type: ignore[assignment]

    # ------------------------------------------------------------- proposing
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        rows: list[int] = []
        counts: list[int] = []
        for i, (req, n) in enumerate(zip(requests, num_drafts, strict=True)):
            # Draft j + 1 is read at position num_tokens - 1 + j.
            n = min(n, self.max_position - req.num_tokens + 1)
            if n > 0 and self._reserve(req, n):
                rows.append(i)
                counts.append(n)
        if not rows:
            return out
        batch = [requests[i] for i in rows]
        with torch.inference_mode():
            sampling = None
            if self.sample_drafts:
                sampling = DraftSampling.build(batch, counts, self.draft.config.vocab_size,
                                               self.device)  # fmt: skip
            drafts = self._run(batch, counts, sampling)
        for b, (i, n, ids) in enumerate(zip(rows, counts, drafts.tolist(), strict=True)):
            out[i] = ids[:n]
            if sampling is not None:
                requests[i].spec_draft_probs = sampling.probs_of(b, n)
        return out

    def _reserve(self, req: Request, n: int) -> bool:
        """Slots for the draft's K/V up to its (n - 1)-th draft token, taken from the pool
        now: the verify step needs them anyway. A block still shared where the request
        writes next (copied on write by the coming step) gets no drafts this time."""
        if self.pool._needs_copy_on_write(req):
            return False
        num_new = req.num_tokens + n - 1 - req.num_computed_tokens
        return self.pool.allocate_slots(req, num_new) is not None

    def _run(
        self, reqs: list[Request], counts: list[int], sampling: DraftSampling | None
    ) -> torch.Tensor:
        """[len(reqs), max(counts)] draft ids on the device (row i valid up to counts[i]);
        `sampling` (None: argmax for all) picks them and keeps q of those it samples."""

        def pick(logits: torch.Tensor, rows: list[int], j: int) -> torch.Tensor:
            if sampling is None:
                return logits.argmax(dim=-1)
            return sampling.pick(logits, rows, j)

        active = list(range(len(reqs)))
        tokens = pick(self._catch_up(reqs), active, 0)
        drafts = torch.full((len(reqs), max(counts)), -1, dtype=torch.int64, device=self.device)
        drafts[:, 0] = tokens
        for j in range(1, max(counts)):
            keep = [a for a, row in enumerate(active) if counts[row] > j]
            if len(keep) < len(active):
                tokens = tokens.index_select(0, host_to_device(keep, torch.int64, self.device))
                active = [active[a] for a in keep]
            batch = [reqs[row] for row in active]
            starts = [r.num_tokens - 1 + j for r in batch]
            logits = self._forward(batch, starts, [1] * len(batch), device_ids=tokens)
            tokens = pick(logits, active, j)
            if len(active) == len(reqs):
                drafts[:, j] = tokens
            else:
                drafts[host_to_device(active, torch.int64, self.device), j] = tokens
        return drafts

    def _catch_up(self, reqs: list[Request]) -> torch.Tensor:
        """Run the draft over each request's tokens missing from its cache, up to and with
        the last one, in forwards of at most `max_num_batched_tokens` tokens; returns the
        draft's logits at each request's last token (its first draft's), [len(reqs), V]."""
        first: torch.Tensor | None = None
        # Only positions the target holds computed are trusted (a safeguard: the count never
        # passes the known tokens of the last proposal, which are computed by now).
        starts = [min(r.num_draft_computed_tokens, r.num_computed_tokens) for r in reqs]
        todo = list(enumerate(starts))
        while todo:
            budget = self.max_num_batched_tokens
            batch: list[tuple[int, int, int]] = []  # (request, start, length)
            later: list[tuple[int, int]] = []
            for i, start in todo:
                length = min(reqs[i].num_tokens - start, budget)
                if length > 0:
                    batch.append((i, start, length))
                    budget -= length
                if start + length < reqs[i].num_tokens:
                    later.append((i, start + length))
            batch_reqs = [reqs[i] for i, _, _ in batch]
            ids = np.concatenate([
                np.asarray(reqs[i].all_token_ids[s : s + n], dtype=np.int64)
                for i, s, n in batch
            ])  # fmt: skip
            last = self._forward(batch_reqs, [s for _, s, _ in batch], [n for _, _, n in batch],
                                 host_ids=ids)  # fmt: skip
            done = [k for k, (i, s, n) in enumerate(batch) if s + n == reqs[i].num_tokens]
            if len(done) == len(reqs) and first is None:
                first = last  # one forward ran every request to its end, in order
            elif done:
                if first is None:
                    first = last.new_empty((len(reqs), last.shape[1]))
                index = host_to_device(done, torch.int64, self.device)
                rows = host_to_device([batch[k][0] for k in done], torch.int64, self.device)
                first[rows] = last.index_select(0, index)
            for i, s, n in batch:
                reqs[i].num_draft_computed_tokens = s + n
            todo = later
        assert first is not None  # every request's last token was run
        for req, start in zip(reqs, starts, strict=True):
            # Full cached blocks passed now serve later prefix hits with the draft's K/V too.
            self.pool.cache_draft_blocks(req, start)
        return first

    def _staged_inputs(
        self, reqs: list[Request], starts: list[int], lens: list[int],
        host_ids: np.ndarray | None,
    ) -> tuple[StepInputs, torch.Tensor | None] | None:  # fmt: skip
        """A forward of a few tokens laid out in plain Python (`decode_rows`: one decode row a
        token) and staged straight into a captured graph's inputs, with the rows whose logits
        are wanted where a request has more than one (None: every row); None where no graph
        takes it whole. The draft's steps are short and many: numpy's cost per call was most
        of their layout."""
        graphs = self.graphs
        t = sum(lens)
        if graphs is None or t > STAGE_MAX_ROWS or max(lens) > EXPAND_MAX_TOKENS:
            return None

        def plan_for(rows: int, width: int, longest: int, expanded: bool) -> DecodePlan:
            # A graph runs at its padded size, so its attention is planned for that size.
            padded = graphs.graph_size(rows, width) or rows
            return decode_plan(padded, self.num_kv_heads, self.device, longest,
                               fuse_rotary=not expanded)  # fmt: skip

        ids = host_ids.tolist() if host_ids is not None else [0] * t
        inputs = stage_decode_rows(graphs, self.staging, self.block_size,
                                   [r.block_table for r in reqs], starts, lens, ids, plan_for,
                                   [], len(reqs))  # fmt: skip
        if inputs is None:
            return None
        expand = t > len(reqs)
        if not expand:
            return inputs, None
        ends = list(itertools.accumulate(lens))
        return inputs, host_to_device([e - 1 for e in ends], torch.int64, self.device)

    def _forward(
        self,
        reqs: list[Request],
        starts: list[int],
        lens: list[int],
        *,
        host_ids: np.ndarray | None = None,
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft forward over `lens[i]` tokens of request i from position `starts[i]`
        (ids from the host or already on the device); the logits at each one's last token.
        A step of one token a request, or a short catch-up laid out as one decode row per
        token, replays the graph of its padded size where one was captured: staged whole
        when small (`_staged_inputs`), else from the packed buffer a target step uses
        (`step_buffer`)."""
        staged = self._staged_inputs(reqs, starts, lens, host_ids)
        if staged is not None:
            inputs, last_rows = staged
            if device_ids is not None:
                inputs.input_ids.copy_(device_ids)
            assert self.graphs is not None
            hidden = self.graphs.run(inputs)
            if last_rows is not None:  # else one token a request: rows are the logits' rows
                hidden = hidden.index_select(0, last_rows)
            return self.model.compute_logits(hidden)  # type: ignore[operator]
        lens_a = np.asarray(lens, dtype=np.int64)
        qsl, seq_lens, tables, owner, positions, slots = token_layout(
            [r.block_table for r in reqs], np.asarray(starts, dtype=np.int64), lens_a,
            self.block_size,
        )  # fmt: skip
        t, w = int(qsl[-1]), tables.shape[1]
        last_rows = qsl[1:] - 1
        max_q = int(lens_a.max())
        expand = 1 < max_q <= EXPAND_MAX_TOKENS and (
            self.graphs is None or self.graphs.graph_size(t, w) is not None
        )
        if expand:
            qsl, lens_a, seq_lens, tables = one_row_per_token(tables, owner, positions)
            max_q = 1
        b, max_len = len(lens_a), int(seq_lens.max())
        plan = None
        if max_q == 1:
            # A graph runs at its padded size, so its attention is planned for that size.
            padded = self.graphs.graph_size(b, w) if self.graphs is not None else None
            plan = decode_plan(padded or b, self.num_kv_heads, self.device, max_len,
                               fuse_rotary=not expand)  # fmt: skip
        header = StepHeader(
            num_tokens=t, num_seqs=b, table_width=w, num_logits=len(reqs), max_query_len=max_q,
            max_seq_len=max_len, decode_segments=0 if plan is None else plan.segments,
            fuse_rotary=plan is not None and plan.fuse_rotary,
        )  # fmt: skip
        # Larger than a staged step (`_staged_inputs`): the packed buffer, as a target step.
        ids = host_ids if host_ids is not None else np.zeros(t, np.int64)
        arrays = {
            "input_ids": ids,
            "positions": positions,
            "slot_mapping": slots,
            "query_start_loc": qsl,
            "seq_lens": seq_lens,
            "block_tables": tables,
            "logits_indices": last_rows,
            "fills": _NONE,
            "prompt_rows": _NONE,
            "prompt_targets": _NONE,
        }
        buffer = self.staging.to_device(pack(header, arrays))
        inputs = step_inputs(header, buffer, unpack(header, buffer), [])
        if device_ids is not None:
            inputs.input_ids.copy_(device_ids)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
            if expand:  # else one token a request: the graph's rows are the logits' rows
                hidden = hidden.index_select(0, inputs.logits_indices)
            return self.model.compute_logits(hidden)  # type: ignore[operator]
        with set_forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # type: ignore[operator]
