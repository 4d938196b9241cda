"""Sampler and SamplingMetadata on CPU (plus one GPU check that forward never syncs)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from asyncengine.sampler import Sampler, SamplingMetadata, apply_penalties
from asyncengine.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 3

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def build(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: set[int] | None = None,
    device: torch.device = CPU,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1, 2]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        {EOS} if eos is None else eos,
        vocab_size,
        device,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def sample_many(
    logits_row: torch.Tensor,
    params: SamplingParams,
    num_samples: int,
    seed: int = 0,
    device: torch.device = CPU,
) -> torch.Tensor:
    """Counts per token of `num_samples` draws (one batch row per draw)."""
    torch.manual_seed(seed)
    logits = logits_row.to(device).unsqueeze(0).expand(num_samples, -1).contiguous()
    meta = build([params] * num_samples, logits_row.numel(), device=device)
    ids = Sampler()(logits, meta).sampled_token_ids
    return torch.bincount(ids, minlength=logits_row.numel()).double().cpu()


def assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Support exactly the allowed set, frequencies within a chi-square bound (p = 0.001)."""
    expected = expected.double()
    allowed = expected > 0
    assert torch.equal(counts > 0, allowed), (counts, expected)
    total = counts.sum()
    exp_counts = expected[allowed] / expected.sum() * total
    chi2 = ((counts[allowed] - exp_counts) ** 2 / exp_counts).sum().item()
    dof = int(allowed.sum().item()) - 1
    if dof > 0:
        assert chi2 < CHI2_999[dof], (chi2, counts, exp_counts)


# A small known distribution: probabilities 0.5, 0.3, 0.1, 0.06, 0.04 (then zero mass).
PROBS = torch.tensor([0.04, 0.5, 0.06, 0.3, 0.1])
LOGITS = PROBS.log()


# --- metadata ---------------------------------------------------------------------------------


def test_metadata_flags_and_neutral_values() -> None:
    params = [
        SamplingParams(temperature=0, top_k=5, top_p=0.5),  # greedy: filters don't count
        SamplingParams(temperature=0.7, top_k=100),  # top_k >= vocab: disabled
        SamplingParams(temperature=1.0, top_k=-1),
    ]
    meta = build(params, vocab_size=32)
    assert meta.num_rows == 3
    assert not meta.all_greedy and not meta.all_random and meta.no_penalties
    assert meta.is_greedy.tolist() == [True, False, False]
    assert meta.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert meta.top_k.dtype == torch.int32 and meta.top_k.tolist() == [0, 0, 0]
    # The greedy row's top_p is neutral too: its filters do not count.
    assert meta.top_p.tolist() == [1.0, 1.0, 1.0] and meta.min_p.tolist() == [0.0, 0.0, 0.0]
    assert meta.prompt_token_ids.shape == (3, 0) and meta.output_token_ids.shape == (3, 0)
    assert meta.max_num_logprobs is None and not meta.has_min_tokens_ban


def test_metadata_pads_penalty_tokens_with_vocab_size() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5)]
    meta = build(params, 10, prompts=[[1, 2, 3], [4]], outputs=[[5], [6, 7]])
    assert not meta.no_penalties and not meta.no_repetition_penalty
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [4, 10, 10]]
    assert meta.output_token_ids.tolist() == [[5, 10], [6, 7]]


def test_metadata_min_tokens_ban_pairs() -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[7]),  # under min_tokens: eos + 7
        SamplingParams(min_tokens=1, stop_token_ids=[7]),  # already has 1 token: no ban
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[8]),  # 8 only
        SamplingParams(min_tokens=2, stop_token_ids=[99]),  # out-of-vocab ids are dropped
    ]
    meta = build(params, 10, outputs=[[1], [1], [], []], eos={EOS, 9})
    pairs = sorted(divmod(i, 10) for i in meta.min_tokens_ban.tolist())  # (row, token)
    assert pairs == [(0, EOS), (0, 7), (0, 9), (2, 8), (3, EOS), (3, 9)]
    assert meta.has_min_tokens_ban


def test_a_token_in_flight_counts_as_output() -> None:
    """Asynchronous scheduling: a row whose last token is still on the device gets it from
    there; the penalties count it and the min_tokens ban counts it as written, exactly as
    if the host had it."""
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5, 4.0, 0.0, -2.0]] * 2)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5),
              SamplingParams(frequency_penalty=0.5, min_tokens=2, stop_token_ids=[7])]  # fmt: skip
    ids = torch.tensor([2, 6])  # row 1's is not in flight: its value is never read
    in_flight = ([True, False], ids)
    meta = SamplingMetadata.build(params, [[0, 5]] * 2, [[2, 5], [3]], [None, None], {EOS}, 8,
                                  CPU, in_flight=in_flight)  # fmt: skip
    known = build(params, 8, prompts=[[0, 5]] * 2, outputs=[[2, 5, 2], [3]])
    torch.testing.assert_close(apply_penalties(logits.clone(), meta),
                               apply_penalties(logits.clone(), known))  # fmt: skip
    assert meta.min_tokens_ban.tolist() == known.min_tokens_ban.tolist() != []
    # Row 1 with its second token in flight has reached min_tokens: no ban left.
    done = SamplingMetadata.build(params[1:], [[0, 5]], [[3]], [None], {EOS}, 8, CPU,
                                  in_flight=([True], torch.tensor([4])))  # fmt: skip
    assert not done.has_min_tokens_ban


def test_metadata_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[1]], [], [None], {EOS}, 8, CPU)


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000).to(dtype)
    meta = build([SamplingParams(temperature=0)] * 16, 1000)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None and out.logprob_token_ids is None


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 200)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=20) for i in range(8)]
    before = logits.clone()
    ids = Sampler()(logits, build(params, 200)).sampled_token_ids
    assert torch.equal(ids[1::2], logits[1::2].argmax(dim=-1))
    assert torch.equal(logits, before)  # the caller's logits are never modified


# --- distributions ----------------------------------------------------------------------------


def test_temperature_sampling_distribution() -> None:
    counts = sample_many(LOGITS, SamplingParams(temperature=1.0), 40_000)
    assert_distribution(counts, PROBS)
    counts = sample_many(LOGITS, SamplingParams(temperature=0.5), 40_000, seed=1)
    assert_distribution(counts, torch.softmax(LOGITS / 0.5, dim=-1))


def test_top_k_distribution() -> None:
    counts = sample_many(LOGITS, SamplingParams(top_k=2), 40_000)
    expected = torch.where(PROBS >= 0.3, PROBS, 0.0)  # the two most likely tokens
    assert_distribution(counts, expected)


def test_top_k_one_is_greedy() -> None:
    counts = sample_many(LOGITS, SamplingParams(top_k=1, temperature=2.0), 2_000)
    assert counts.tolist() == [0, 2_000, 0, 0, 0]


def test_top_p_distribution() -> None:
    # Smallest top set with mass >= 0.75: {0.5, 0.3} (0.8).
    counts = sample_many(LOGITS, SamplingParams(top_p=0.75), 40_000)
    assert_distribution(counts, torch.where(PROBS >= 0.3, PROBS, 0.0))
    # Mass >= 0.85 needs a third token: {0.5, 0.3, 0.1}.
    counts = sample_many(LOGITS, SamplingParams(top_p=0.85), 40_000, seed=1)
    assert_distribution(counts, torch.where(PROBS >= 0.1, PROBS, 0.0))


def test_min_p_distribution() -> None:
    # Keep tokens with prob >= 0.15 * 0.5 = 0.075: {0.5, 0.3, 0.1}.
    counts = sample_many(LOGITS, SamplingParams(min_p=0.15), 40_000)
    assert_distribution(counts, torch.where(PROBS >= 0.1, PROBS, 0.0))


def test_combined_filters_with_temperature() -> None:
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05)
    probs = torch.softmax(LOGITS / 0.8, dim=-1)
    ranked = probs.sort(descending=True).values
    after_top_k = ranked[:4] / ranked[:4].sum()
    # The case this test is about: top_k drops one token, top_p then needs exactly three of
    # the renormalised four, and min_p removes nothing more.
    assert after_top_k[:2].sum() < 0.9 <= after_top_k[:3].sum()
    assert after_top_k[2] >= 0.05 * after_top_k[0]
    counts = sample_many(LOGITS, params, 40_000)
    assert_distribution(counts, torch.where(probs >= ranked[2], probs, 0.0))


def test_filters_only_apply_to_their_own_rows() -> None:
    torch.manual_seed(3)
    n = 20_000
    logits = LOGITS.unsqueeze(0).expand(2 * n, -1).contiguous()
    params = [SamplingParams(top_k=1)] * n + [SamplingParams()] * n
    ids = Sampler()(logits, build(params, 5)).sampled_token_ids
    assert torch.all(ids[:n] == 1)
    assert_distribution(torch.bincount(ids[n:], minlength=5).double(), PROBS)


# --- seeds ------------------------------------------------------------------------------------


def run_steps(
    logits_per_step: list[torch.Tensor],
    params: list[SamplingParams],
    row_seeds: list[int | None],
) -> torch.Tensor:
    """Sample one batch per step; seeded rows keep one generator across steps like a request."""
    gens = [seeded(s) if s is not None else None for s in row_seeds]
    vocab = logits_per_step[0].shape[1]
    return torch.stack(
        [
            Sampler()(lg, build(params, vocab, generators=gens)).sampled_token_ids
            for lg in logits_per_step
        ]
    )


@pytest.mark.parametrize(
    "target_params",
    [SamplingParams(temperature=1.0, seed=1234), SamplingParams(top_k=40, top_p=0.9, seed=1234)],
    ids=["temperature", "filtered"],
)
def test_seeded_request_is_batch_independent(target_params: SamplingParams) -> None:
    vocab, steps = 300, 12
    torch.manual_seed(7)
    target_logits = [torch.randn(vocab) * 2 for _ in range(steps)]

    def in_batch(position: int, others: list[tuple[SamplingParams, int | None]]) -> list[int]:
        params = [p for p, _ in others]
        seeds = [s for _, s in others]
        params.insert(position, target_params)
        seeds.insert(position, 1234)
        per_step = []
        for lg in target_logits:
            rows = torch.randn(len(params), vocab) * 2
            rows[position] = lg
            per_step.append(rows)
        torch.manual_seed(99 + position)  # unseeded rows must not disturb the seeded one
        return run_steps(per_step, params, seeds)[:, position].tolist()

    alone = in_batch(0, [])
    batches = [
        (0, [(SamplingParams(), None)]),
        (
            2,
            [
                (SamplingParams(seed=5), 5),
                (SamplingParams(temperature=0), None),
                (SamplingParams(top_k=3), None),
            ],
        ),
        (5, [(SamplingParams(seed=i, min_p=0.1), i) for i in range(7)]),
        (1, [(SamplingParams(temperature=0.3), None)] * 15),
    ]
    for position, others in batches:
        assert in_batch(position, others) == alone
    assert len(set(alone)) > 1  # actually random across steps


def test_different_seeds_give_different_tokens() -> None:
    torch.manual_seed(0)
    per_step = [torch.randn(1, 1000) for _ in range(10)]
    a = run_steps(per_step, [SamplingParams(seed=1)], [1])
    b = run_steps(per_step, [SamplingParams(seed=2)], [2])
    assert not torch.equal(a, b)


# --- penalties --------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(3, vocab) * 3
    prompts = [[1, 2, 3, 3], [10], [5, 6]]
    outputs = [[7, 1], [11, 12, 13, 10], []]
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    ours = apply_penalties(logits.clone(), build(params, vocab, prompts=prompts, outputs=outputs))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(3):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = hf(input_ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(ours[row], expected, rtol=0, atol=0)


def test_repetition_penalty_rows_differ() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 16)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams()]
    ours = apply_penalties(logits.clone(), build(params, 16, prompts=[[4, 5], [4, 5]]))
    hf = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[4, 5]]), logits[:1].clone())
    torch.testing.assert_close(ours[0], hf[0], rtol=0, atol=0)
    assert torch.equal(ours[1], logits[1])


def test_frequency_and_presence_penalties_by_hand() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5, 4.0, 0.0, -2.0]])
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    # Token 2 appears twice, 5 once in the output; prompt tokens 0 and 5 don't count.
    meta = build(params, 8, prompts=[[0, 5]], outputs=[[2, 5, 2]])
    ours = apply_penalties(logits.clone(), meta)
    expected = logits.clone()
    expected[0, 2] -= 0.5 * 2 + 0.25
    expected[0, 5] -= 0.5 * 1 + 0.25
    torch.testing.assert_close(ours, expected)


def test_all_penalties_together_order() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)]
    ours = apply_penalties(logits.clone(), build(params, 4, prompts=[[0]], outputs=[[1, 1]]))
    # Repetition first (0 from the prompt, 1 from the output), then frequency + presence on 1.
    expected = torch.tensor([[1.0, -2.0 - 2.0 - 0.5, 3.0, 0.5]])
    torch.testing.assert_close(ours, expected)


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    sampler = Sampler()
    plain = build([SamplingParams(temperature=0)], 4, prompts=[[3]], outputs=[[1]])
    assert sampler(logits, plain).sampled_token_ids.tolist() == [1]
    penal = build(
        [SamplingParams(temperature=0, repetition_penalty=1.5)], 4, prompts=[[3]], outputs=[[1]]
    )
    assert sampler(logits, penal).sampled_token_ids.tolist() == [2]  # 5 / 1.5 < 4
    freq = build(
        [SamplingParams(temperature=0, frequency_penalty=2.0)], 4, prompts=[[3]], outputs=[[1]]
    )
    assert sampler(logits, freq).sampled_token_ids.tolist() == [2]


# --- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 3.0]])  # EOS (3) then 4 are the best
    sampler = Sampler()

    def greedy(produced: int = 0, **kw: object) -> int:
        params = SamplingParams(temperature=0, stop_token_ids=[4], **kw)
        meta = build([params], 6, outputs=[[0] * produced])
        return sampler(logits, meta).sampled_token_ids.item()

    assert greedy() == EOS
    assert greedy(min_tokens=2) == 5  # both EOS and the stop id are banned
    assert greedy(produced=1, min_tokens=2) == 5
    assert greedy(min_tokens=2, ignore_eos=True) == EOS  # EOS does not stop, so not banned
    assert greedy(produced=2, min_tokens=2) == EOS  # min_tokens reached: no ban


def test_min_tokens_ban_holds_when_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(4096, 6)
    logits[:, EOS] = 5.0
    params = [SamplingParams(min_tokens=1, stop_token_ids=[0])] * 4096
    ids = Sampler()(logits, build(params, 6)).sampled_token_ids
    assert not torch.isin(ids, torch.tensor([0, EOS])).any()
    assert set(ids.tolist()) == {1, 2, 4, 5}


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = (torch.randn(4, vocab) * 2).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0, frequency_penalty=1.0),
        SamplingParams(logprobs=1, top_k=5),
    ]
    out = Sampler()(logits, build(params, vocab, outputs=[[1, 2], [3], [4, 4], []]))
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == (4, 4) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.dtype == torch.int64
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(
        out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    )
    top_lp, top_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_lp)
    assert torch.all(out.logprobs[:, 1:-1] >= out.logprobs[:, 2:])


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=0)], 3))
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.logprob_token_ids.tolist() == [[2]]
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[:, 2:])


# --- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_never_syncs_on_gpu() -> None:
    device = torch.device("cuda")
    vocab = 32_000
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=3, top_k=50, top_p=0.9, min_p=0.05, logprobs=5),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=4),
        SamplingParams(temperature=0.7),
    ]
    gens = [None, torch.Generator(device=device).manual_seed(3), None, None]
    meta = build(params, vocab, outputs=[[1], [2, 3], [4], []], generators=gens, device=device)
    logits = torch.randn(4, vocab, device=device, dtype=torch.bfloat16)
    sampler = Sampler()
    sampler(logits, meta)  # warm up lazy initialisation outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = out.sampled_token_ids.cpu()
    assert ids[0].item() == logits[0].float().argmax().item()
    assert ids[2].item() != EOS
    assert out.logprobs is not None and out.logprobs.shape == (4, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_filtered_distributions_and_seeds_on_gpu() -> None:
    device = torch.device("cuda")
    counts = sample_many(LOGITS, SamplingParams(top_k=2), 100_000, device=device)
    assert_distribution(counts, torch.where(PROBS >= 0.3, PROBS, 0.0))
    counts = sample_many(LOGITS, SamplingParams(top_p=0.85, min_p=0.15), 100_000, device=device)
    assert_distribution(counts, torch.where(PROBS >= 0.1, PROBS, 0.0))

    # A seeded row samples the same tokens whatever the rest of its batch is.
    vocab = 32_000
    torch.manual_seed(0)
    target = torch.randn(vocab, device=device)
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=11)

    def draw(batch: int, row: int, others: SamplingParams) -> list[int]:
        gens = [None] * batch
        gens[row] = torch.Generator(device=device).manual_seed(11)
        rows = [others] * batch
        rows[row] = params
        meta = build(rows, vocab, generators=gens, device=device)
        tokens = []
        for _ in range(8):
            logits = torch.randn(batch, vocab, device=device)
            logits[row] = target
            tokens.append(Sampler()(logits, meta).sampled_token_ids[row].item())
        return tokens

    alone = draw(1, 0, SamplingParams())
    assert draw(7, 3, SamplingParams()) == alone
    assert draw(33, 32, SamplingParams(temperature=0)) == alone
    assert draw(4, 1, SamplingParams(top_k=5, min_p=0.2)) == alone
