"""The verify step: the target's logits at the k + 1 positions of each speculating request
turned into the tokens it keeps, and the host's view of them.

`launch_verify` runs after the model runner's forward (which computed logits at every
position a speculating request needs) and enqueues sampling and verification on the device.
`VerifyStep.result()` copies the emitted ids and the accept flags once and flattens them:
each request's kept tokens follow one another in `StepResult.requests`/`token_ids`, so the
engine appends them one by one and its stop checks (EOS, stop ids, stop strings,
max_tokens) cut a run short exactly where a step at a time would have stopped. The per-request
verdicts (`StepResult.spec`) tell the engine how many drafts were accepted: the one place
that knows, for rollback, metrics and anything that must advance only over kept tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncengine.model_runner import InflightStep, StepResult, _logprob_dicts, _plain_greedy
from asyncengine.prompt_logprobs import PromptLogprobPlan, ScoredRows
from asyncengine.request import Request
from asyncengine.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncengine.spec_decode.rejection_sampler import verify_rows


@dataclass(frozen=True)
class SpecVerdict:
    """One speculating request's outcome in a verify step."""

    request: Request
    num_draft_tokens: int
    num_accepted_tokens: int  # leading drafts kept; one more token (recovered/bonus) follows


class VerifyStep(InflightStep):
    """A launched step with speculating requests. Its ids never feed a next step on the
    device (the engine resolves it before scheduling again), so `token_ids` stays None.

    `packed` holds each row's emitted id and whether its draft was accepted, or, with
    `host_drafts` (every row's draft, -1 for a request's last row), the ids alone: a greedy
    row keeps its draft exactly when the draft is its argmax, which the host checks on the
    ids it copies back anyway."""

    def __init__(
        self,
        requests: list[Request],
        num_spec: list[int],
        packed: torch.Tensor,
        logprobs: tuple[torch.Tensor, torch.Tensor] | None,
        scheduled: list[Request],
        prompt_logprobs: tuple[ScoredRows, PromptLogprobPlan] | None = None,
        host_drafts: list[int] | None = None,
    ) -> None:
        super().__init__(requests, packed, logprobs, scheduled, prompt_logprobs)
        self.token_ids = None
        self.rows = {}
        self.num_spec = num_spec
        self.host_drafts = host_drafts

    def result(self) -> StepResult:
        if self._result is not None:
            return self._result
        self.wait()
        assert self._host_ids is not None
        if self.host_drafts is not None:
            ids = self._host_ids.tolist()
            accepted = [i == d for i, d in zip(ids, self.host_drafts, strict=True)]
        else:
            ids, accepted = self._host_ids.tolist()
        row_reqs = [r for r, k in zip(self.requests, self.num_spec, strict=True)
                    for _ in range(k + 1)]  # fmt: skip
        lps = None
        if self._host_logprobs is not None:
            lps = _logprob_dicts(*self._host_logprobs, row_reqs)
        flat_reqs: list[Request] = []
        flat_ids: list[int] = []
        flat_lps: list[dict[int, float]] | None = [] if lps is not None else None
        verdicts: list[SpecVerdict] = []
        row = 0
        for req, k in zip(self.requests, self.num_spec, strict=True):
            a = 0
            while a < k and accepted[row + a]:
                a += 1
            for j in range(row, row + a + 1):
                flat_reqs.append(req)
                flat_ids.append(ids[j])
                if flat_lps is not None and lps is not None:
                    flat_lps.append(lps[j])
            if k:
                verdicts.append(SpecVerdict(req, k, a))
            row += k + 1
        self._result = StepResult(flat_reqs, flat_ids, flat_lps, self._prompt_logprobs,
                                  spec=verdicts)
        return self._result


def launch_verify(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[Request],
    num_spec: Sequence[int],
    scheduled: list[Request],
    *,
    eos_token_ids: set[int],
    vocab_size: int,
    prompt_logprobs: tuple[ScoredRows, PromptLogprobPlan] | None = None,
) -> VerifyStep:
    """Sample and verify on the device: `logits` has `num_spec[i] + 1` rows for request i,
    in order (a request without drafts has one row and samples as usual). `prompt_logprobs`:
    what the same step scored for other requests' prompts, handed back with the result."""
    reqs = list(requests)
    spec = list(num_spec)
    if all(_plain_greedy(r) for r in reqs):
        drafts = [d for req, k in zip(reqs, spec, strict=True)
                  for d in (*req.spec_token_ids[:k], -1)]  # fmt: skip
        return VerifyStep(reqs, spec, logits.argmax(dim=-1), None, scheduled, prompt_logprobs,
                          host_drafts=drafts)  # fmt: skip
    row_params, row_prompts, row_outputs, row_gens = [], [], [], []
    draft_ids: list[int] = []
    random_rows: list[bool] = []
    draft_probs: list[tuple[int, torch.Tensor]] = []  # (first row, q of its k drafts)
    for req, k in zip(reqs, spec, strict=True):
        drafts = req.spec_token_ids[:k]
        if k and req.spec_draft_probs is not None and not req.params.is_greedy:
            draft_probs.append((len(draft_ids), req.spec_draft_probs[:k]))
        for j in range(k + 1):
            row_params.append(req.params)
            row_prompts.append(req.prompt_token_ids)
            # Penalties and the min_tokens ban of row j see the drafts before it.
            row_outputs.append(req.output_token_ids + drafts[:j] if j else req.output_token_ids)
            row_gens.append(req.generator)
            draft_ids.append(drafts[j] if j < k else -1)
            random_rows.append(not req.params.is_greedy)
    meta = SamplingMetadata.build(
        row_params, row_prompts, row_outputs, row_gens, eos_token_ids, vocab_size, logits.device
    )
    num_top = meta.max_num_logprobs
    meta.max_num_logprobs = None  # logprobs are of the emitted tokens, gathered below
    sampled = sampler(logits, meta).sampled_token_ids
    out, accepted = verify_rows(logits, meta, sampled, draft_ids, random_rows, draft_probs)
    logprobs = None
    if num_top is not None:
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        logprobs = gather_logprobs(raw, out, num_top)
    packed = torch.stack([out, accepted.to(torch.int64)])
    return VerifyStep(reqs, spec, packed, logprobs, scheduled, prompt_logprobs)
