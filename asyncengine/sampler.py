"""The sampler: turns one step's logits into token ids (and logprobs) on the logits' device.

It applies, in the order HF and vLLM do, the min_tokens ban, the repetition / frequency /
presence penalties, greedy argmax or temperature plus top-k / top-p / min-p sampling (the
filtering and the exponential race live in `asyncengine_kernels.sampling`), and gathers logprobs of
the raw logits. `forward` never syncs with the host; the engine copies the sampled ids once.
It touches no engine state: everything it needs arrives in a `SamplingMetadata`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from asyncengine.sampling_params import SamplingParams
from asyncengine_kernels.sampling import sample_from_logits

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (SamplingParams.is_greedy)


def host_to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: from pageable memory
    a copy to the GPU first waits for the stream's earlier work (the step's forward), so the
    list goes through pinned memory and the copy is queued."""
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step, one row per request that samples a token.

    Tensors live on the logits' device; the boolean flags are host values that let the sampler
    skip whole stages (penalties, the min_tokens ban, random sampling) without a sync. There
    are no flags for the top-k / top-p / min-p filters: the random path always runs the same
    filtering op, so that a seeded row samples alike whatever its batch asks for. Disabled
    filters hold neutral values (top_k 0, top_p 1, min_p 0); greedy rows carry temperature 1
    (so dividing is safe) and are marked in `is_greedy`.
    """

    temperature: torch.Tensor  # float32 [B]
    is_greedy: torch.Tensor  # bool [B]
    top_k: torch.Tensor  # int32 [B], <= 0 disabled
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    repetition_penalties: torch.Tensor  # float32 [B]
    frequency_penalties: torch.Tensor  # float32 [B]
    presence_penalties: torch.Tensor  # float32 [B]
    # Token ids padded with vocab_size (a column that is dropped after scattering); [B, 0] when
    # no row needs them.
    prompt_token_ids: torch.Tensor  # int64 [B, Lp]
    output_token_ids: torch.Tensor  # int64 [B, Lo]
    # Stop ids of rows still under min_tokens, as flat indices row * vocab_size + token into
    # the logits (index_fill_ on a flat view does not sync, unlike indexing by two tensors).
    min_tokens_ban: torch.Tensor  # int64 [K]
    generators: dict[int, torch.Generator]  # row -> the seeded request's own generator
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_repetition_penalty: bool
    no_frequency_presence_penalties: bool
    has_min_tokens_ban: bool
    max_num_logprobs: int | None  # N: top-N columns besides the sampled token; None = none asked

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Iterable[int],
        vocab_size: int,
        device: torch.device | str,
        in_flight: tuple[list[bool], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's params into device tensors (host lists in, one copy each out).

        `in_flight` (asynchronous scheduling): which rows' last output token is still on the
        device, sampled by the step before, and the ids ([B] int64 on the device; any value
        where a row has none). `output_token_ids` then lack that token: the penalties take it
        from the device, and the min_tokens ban counts it, so that a step need not wait for
        the one before to sample."""
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators differ")
        device = torch.device(device)
        eos = frozenset(eos_token_ids)

        greedy = [p.is_greedy for p in params]
        temperature = [
            1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)
        ]
        # Greedy rows ignore the filters, so they must not turn the fast-path flags off.
        top_k = [
            0 if g or p.top_k <= 0 or p.top_k >= vocab_size else p.top_k
            for p, g in zip(params, greedy, strict=True)
        ]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy, strict=True)]
        rep = [float(p.repetition_penalty) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]

        no_rep = all(r == 1.0 for r in rep)
        no_freq_pres = all(f == 0.0 for f in freq) and all(p == 0.0 for p in pres)
        no_penalties = no_rep and no_freq_pres

        pending = in_flight[0] if in_flight is not None else [False] * num_rows
        ban: list[int] = []
        for row, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
            if len(out) + pending[row] >= p.min_tokens:
                continue
            # As in vLLM: under min_tokens, every id that would end the request is banned.
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids |= eos
            ban.extend(row * vocab_size + t for t in sorted(stop_ids) if 0 <= t < vocab_size)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(asked) if asked else None

        def padded(rows: Sequence[Sequence[int]], needed: bool) -> torch.Tensor:
            width = max((len(r) for r in rows), default=0) if needed else 0
            data = [list(r) + [vocab_size] * (width - len(r)) for r in rows] if width else []
            if not data:
                return torch.empty((num_rows, 0), dtype=torch.int64, device=device)
            return host_to_device(data, torch.int64, device)

        outputs = padded(output_token_ids, not no_penalties)
        if not no_penalties and in_flight is not None and any(pending):
            # The token in flight as one more column (vocab_size, dropped, where none).
            flags = host_to_device(pending, torch.bool, device)
            column = torch.where(flags, in_flight[1], vocab_size)
            outputs = torch.cat([outputs, column.unsqueeze(1)], dim=1)
        all_greedy = all(greedy)
        return cls(
            temperature=host_to_device(temperature, torch.float32, device),
            is_greedy=host_to_device(greedy, torch.bool, device),
            top_k=host_to_device(top_k, torch.int32, device),
            top_p=host_to_device(top_p, torch.float32, device),
            min_p=host_to_device(min_p, torch.float32, device),
            repetition_penalties=host_to_device(rep, torch.float32, device),
            frequency_penalties=host_to_device(freq, torch.float32, device),
            presence_penalties=host_to_device(pres, torch.float32, device),
            prompt_token_ids=padded(prompt_token_ids, not no_rep),
            output_token_ids=outputs,
            min_tokens_ban=host_to_device(ban, torch.int64, device),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            all_greedy=all_greedy,
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_repetition_penalty=no_rep,
            no_frequency_presence_penalties=no_freq_pres,
            has_min_tokens_ban=bool(ban),
            max_num_logprobs=max_num_logprobs,
        )


@dataclass
class SamplerOutput:
    """Sampled ids, plus the logprobs table when any row asked for logprobs.

    Column 0 of the logprobs table is the sampled token, columns 1..N the top-N tokens by raw
    logprob (N = the batch's largest `logprobs`); the engine trims each row to its own N.
    """

    sampled_token_ids: torch.Tensor  # int64 [B]
    logprob_token_ids: torch.Tensor | None = None  # int64 [B, N + 1]
    logprobs: torch.Tensor | None = None  # float32 [B, N + 1]


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, V]: which tokens appear in each row (padding ids == vocab_size are dropped)."""
    mask = torch.zeros(
        (token_ids.shape[0], vocab_size + 1), dtype=torch.bool, device=token_ids.device
    )
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V]: how many times each token appears in each row."""
    counts = torch.zeros(
        (token_ids.shape[0], vocab_size + 1), dtype=torch.float32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty as HF applies it (prompt and output tokens), then OpenAI's frequency
    and presence penalties (output tokens only). May modify the fp32 `logits` in place; use the
    returned tensor."""
    vocab_size = logits.shape[1]
    if not meta.no_repetition_penalty:
        seen = _token_mask(meta.prompt_token_ids, vocab_size)
        if meta.output_token_ids.shape[1]:
            seen |= _token_mask(meta.output_token_ids, vocab_size)
        pen = meta.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(seen, penalized, logits)
    if not meta.no_frequency_presence_penalties and meta.output_token_ids.shape[1]:
        counts = _token_counts(meta.output_token_ids, vocab_size)
        logits -= meta.frequency_penalties.unsqueeze(1) * counts
        logits -= meta.presence_penalties.unsqueeze(1) * (counts > 0).to(torch.float32)
    return logits


def exponential_noise(
    shape: tuple[int, int], generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """Exponential(1) noise for the exponential race; a seeded row draws its whole row from its
    own generator, so its sample does not depend on the rest of the batch."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) < shape[0]:
        noise.exponential_()  # unseeded rows share the default generator
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return noise


class Sampler(torch.nn.Module):
    """Samples one token per row of `logits` according to `SamplingMetadata`."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Copy to fp32 so the in-place steps below never touch the caller's tensor.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )

        if meta.has_min_tokens_ban:
            logits.view(-1).index_fill_(0, meta.min_tokens_ban, float("-inf"))
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)

        greedy_ids = logits.argmax(dim=-1) if not meta.all_random else None
        if meta.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            sampled = self._sample_random(logits, meta)
            if greedy_ids is not None:
                sampled = torch.where(meta.is_greedy, greedy_ids, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=lps)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits.div_(meta.temperature.unsqueeze(1))
        noise = exponential_noise(tuple(logits.shape), meta.generators, logits.device)
        # Always the same op, even without filters (it has its own cheap path then): a seeded
        # row must sample identically whatever the other rows of its batch ask for.
        return sample_from_logits(logits, meta.top_k, meta.top_p, meta.min_p, noise)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column 0: the sampled token and its logprob; columns 1..num_top: the top tokens."""
    sampled = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled)
    if num_top == 0:
        return sampled, sampled_lp
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1)
