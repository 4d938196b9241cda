"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which rows of a step score which
prompt tokens, their scoring on the device in bounded chunks, and the vLLM-shaped dicts they
become on the host.

The hidden state at prompt position p predicts token p + 1, so a chunk of a P-token prompt
covering positions [s, e) scores tokens s + 1 .. min(e, P - 1); the prompt's last position
predicts the first generated token, which the sampler handles. A request's scored positions
only grow (`Request.prompt_logprob_pos`), so a prompt recomputed after a preemption is not
scored twice; the scheduler gives such a request no prefix-cache hit, so no position is
skipped. Only a request's first sequence scores: the prompt belongs to the request.

Scoring runs the LM head over at most `chunk_rows(vocab)` rows at a time, so a long prompt
never holds a [tokens x vocab] float32 tensor at once. Under tensor parallelism the LM head
is a collective: every rank runs `lm_head_chunks` over the same rows in the same order.
Steps where nobody asks for prompt logprobs never reach this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from asyncengine.outputs import Logprob
from asyncengine.request import Request

# Logit elements (float32) one chunk may hold: 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def chunk_rows(vocab_size: int) -> int:
    """Rows of hidden states the LM head takes at once when scoring prompts."""
    return max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether `req` still has prompt tokens to score (its first sequence only)."""
    return (
        req.params.prompt_logprobs is not None
        and req.index == 0
        and req.prompt_logprob_pos < req.num_prompt_tokens - 1
    )


@dataclass
class PromptSpan:
    """Prompt tokens [first, first + count) of `request` scored by one step, top-`k` each."""

    request: Request
    first: int
    count: int
    k: int


@dataclass
class PromptLogprobPlan:
    """A step's prompt rows to score: their flat rows in the step, the token each predicts,
    and the spans they belong to (in row order)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    spans: list[PromptSpan] = field(default_factory=list)

    def add(self, req: Request, row: int, start: int, num_new: int) -> None:
        """Plan the prompt positions among [start, start + num_new) that `req` has not
        scored yet; `row` is the flat row of position `start`."""
        lo = max(start, req.prompt_logprob_pos)
        hi = min(start + num_new, req.num_prompt_tokens - 1)
        if lo > req.prompt_logprob_pos:
            raise RuntimeError(
                f"request {req.request_id} skipped prompt positions "
                f"{req.prompt_logprob_pos}..{lo - 1} it must score"
            )
        if hi <= lo:
            return
        self.rows.extend(range(row + lo - start, row + hi - start))
        self.targets.extend(req.prompt_token_ids[lo + 1 : hi + 1])
        k = req.params.prompt_logprobs or 0
        self.spans.append(PromptSpan(req, lo + 1, hi - lo, k))
        req.prompt_logprob_pos = hi

    @property
    def max_k(self) -> int:
        return max((s.k for s in self.spans), default=0)


def lm_head_chunks(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, rows: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 logits) of `hidden` in chunks of `rows` rows."""
    for lo in range(0, hidden.shape[0], rows):
        yield lo, compute_logits(hidden[lo : lo + rows]).float()


@dataclass
class ScoredRows:
    """Per scored row: the target token's logprob and rank, the top-k ids and logprobs."""

    logprobs: torch.Tensor  # float32 [R]
    ranks: torch.Tensor  # int64 [R]
    top_ids: torch.Tensor  # int64 [R, K]
    top_logprobs: torch.Tensor  # float32 [R, K]

    def to(self, device: str, non_blocking: bool = False) -> ScoredRows:
        return ScoredRows(
            *(t.to(device, non_blocking=non_blocking) for t in (
                self.logprobs, self.ranks, self.top_ids, self.top_logprobs))
        )  # fmt: skip


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    rows: int,
) -> ScoredRows:
    """Log-softmax of each row's logits (float32), gathered at its target and its top k."""
    n = hidden.shape[0]
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ranks = torch.empty(n, dtype=torch.int64, device=hidden.device)
    top_ids = torch.empty((n, k), dtype=torch.int64, device=hidden.device)
    top_lps = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    for lo, logits in lm_head_chunks(compute_logits, hidden, rows):
        lps = torch.log_softmax(logits, dim=-1)
        hi = lo + lps.shape[0]
        target = lps.gather(1, targets[lo:hi, None])
        logprobs[lo:hi] = target[:, 0]
        # vLLM's rank: how many tokens are at least as likely as the target.
        ranks[lo:hi] = (lps >= target).sum(dim=-1)
        if k:
            top = lps.topk(k, dim=-1)
            top_ids[lo:hi], top_lps[lo:hi] = top.indices, top.values
    return ScoredRows(logprobs, ranks, top_ids, top_lps)


def to_dicts(
    scored: ScoredRows, plan: PromptLogprobPlan, decode: Callable[[list[int]], list[str]] | None
) -> list[tuple[Request, list[dict[int, Logprob]]]]:
    """Per span, its requests' position dicts (host tensors in): the prompt token first,
    then its top-k alternatives ranked 1..k, as vLLM orders them."""
    lps, ranks = scored.logprobs.tolist(), scored.ranks.tolist()
    top_ids, top_lps = scored.top_ids.tolist(), scored.top_logprobs.tolist()
    texts: dict[int, str] = {}
    if decode is not None:
        wanted = set(plan.targets)
        for s, row in _span_rows(plan):
            for r in range(row, row + s.count):
                wanted.update(top_ids[r][: s.k])
        ids = sorted(wanted)
        texts = dict(zip(ids, decode(ids), strict=True))
    out = []
    for span, row in _span_rows(plan):
        entries = []
        for r in range(row, row + span.count):
            tid = plan.targets[r]
            entry = {tid: Logprob(lps[r], ranks[r], texts.get(tid))}
            for rank, (t, lp) in enumerate(zip(top_ids[r][: span.k], top_lps[r][: span.k],
                                               strict=True), start=1):  # fmt: skip
                entry.setdefault(t, Logprob(lp, rank, texts.get(t)))
            entries.append(entry)
        out.append((span.request, entries))
    return out


def _span_rows(plan: PromptLogprobPlan) -> Iterator[tuple[PromptSpan, int]]:
    row = 0
    for span in plan.spans:
        yield span, row
        row += span.count
