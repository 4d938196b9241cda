"""A verify step's graph enqueued before its verdict (`asyncengine.prelaunch`): work behind a
closed gate waits for it to open; an armed graph runs once, on the step it is given or on
padding; and a speculating engine that bets on every step keeps its tokens exact.

Off the GPU the gate is `HostGate` and the decode graphs replay eagerly (the GPU's staged
path, as `bench_spec_decode host` runs it): the bookkeeping is the GPU's. The stream-side
gate (`CudaStreamGate`) is covered by the GPU test at the end."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncengine import SamplingParams, model_runner
from asyncengine.prelaunch import GraphPrelaunch, HostGate
from asyncengine.spec_decode.replay import ReplayProposer
from scripts import bench_spec_decode as bench


def test_work_behind_a_closed_gate_waits_for_its_value() -> None:
    gate, ran = HostGate(), []
    gate.enqueue(lambda: ran.append("open"))
    gate.close(3)
    gate.enqueue(lambda: ran.append("held"))
    gate.open(2)
    assert ran == ["open"]
    gate.open(3)
    assert ran == ["open", "held"]
    gate.enqueue(lambda: ran.append("after"))
    assert ran == ["open", "held", "after"]


class _Graphs:
    """The part of `DecodeGraphs` a prelaunch uses: a static buffer, one graph per key that
    records the image it saw, and `stage_image`'s padding."""

    sizes = (4, 8)
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.static = torch.zeros(64, dtype=torch.uint8)
        self.replays = 0
        self.seen: list[tuple[tuple[int, str], list[int]]] = []
        self.graphs = {key: self._graph(key) for key in ((4, "a"), (8, "a"), (8, "b"))}

    def _graph(self, key: tuple[int, str]) -> SimpleNamespace:
        def replay() -> None:
            self.seen.append((key, self.static[: self.image_bytes(key[0])].tolist()))

        return SimpleNamespace(replay=replay)

    def image_bytes(self, padded: int) -> int:
        return padded

    def stage_image(self, padded: int, *fields: list[int]) -> np.ndarray:
        assert not any(fields)  # a prelaunch stages only padding itself
        return np.full(padded, 255, dtype=np.uint8)


def test_an_armed_graph_runs_once_on_what_it_is_given() -> None:
    graphs = _Graphs()
    pre = GraphPrelaunch(graphs, HostGate())  # type: ignore[arg-type]
    pre.arm(8, "a")
    assert pre.takes(8, "a") and not pre.takes(8, "b") and not pre.takes(4, "a")
    assert graphs.seen == []  # nothing runs before the step is known
    pre.fire(np.arange(8, dtype=np.uint8))
    assert graphs.seen == [((8, "a"), list(range(8)))] and graphs.replays == 1
    assert pre.armed is None and pre.fired == 1
    pre.release()  # nothing armed: nothing runs
    assert len(graphs.seen) == 1 and pre.released == 0
    with pytest.raises(AssertionError):
        pre.fire(np.zeros(8, np.uint8))


def test_a_lost_bet_runs_the_graph_on_padding() -> None:
    graphs = _Graphs()
    pre = GraphPrelaunch(graphs, HostGate())  # type: ignore[arg-type]
    pre.arm(4, "a")
    pre.release()
    assert graphs.seen == [((4, "a"), [255] * 4)] and pre.released == 1
    # The next arm uses the other image and sees only what it is given.
    pre.arm(8, "b")
    pre.fire(np.full(8, 7, dtype=np.uint8))
    assert graphs.seen[-1] == ((8, "b"), [7] * 8) and graphs.replays == 2


def _args() -> argparse.Namespace:
    return argparse.Namespace(model=None, shape="tiny", load_format="auto", device="cpu",
                              prompt_len=24, max_tokens=40, max_batch=8, enforce_eager=False,
                              repeats=1, graph_head_layers=0)  # fmt: skip


class _Uneven:
    """Replayed drafts, but none on every seventh proposal and two on every fifth: plain
    steps and shorter verify steps, which pad into the armed graph."""

    def __init__(self, inner: ReplayProposer) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        self.calls += 1
        drafts = self.inner.propose(requests, num_drafts)
        if self.calls % 7 == 0:
            return [[] for _ in drafts]
        return [d[:2] for d in drafts] if self.calls % 5 == 0 else drafts


@pytest.mark.parametrize("acceptance,uneven", [(0.7, False), (0.0, False), (0.9, True)])
def test_engine_betting_on_every_verify_step_keeps_greedy_tokens(
    acceptance: float, uneven: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every verify step that may be followed by another like it arms the next graph; the
    next launch fires it (same rows, or fewer padded into it) or releases it. The tokens are
    those of the engine without speculation, and nothing is left armed."""
    args = _args()
    bench._default_model(args)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = bench._engine(args, None)
    vocab = plain.llm_engine.model_config.vocab_size
    prompts = bench._prompts(2, 24, vocab)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.llm_engine.shutdown()

    llm = bench._engine(args, 4)
    bench._eager_graphs(llm)
    runner = llm.llm_engine.runner
    pre = GraphPrelaunch(runner.graphs, HostGate())
    runner.prelaunch = pre
    fired_rows: list[tuple[int, int]] = []  # (rows, padded) of each step an armed graph took
    staged = model_runner.staged_step_inputs

    def recording(graphs, staging, padded, header, input_ids, *rest):  # type: ignore[no-untyped-def]
        if pre.takes(padded, header.decode_plan):
            fired_rows.append((len(input_ids), padded))
        return staged(graphs, staging, padded, header, input_ids, *rest)

    monkeypatch.setattr(model_runner, "staged_step_inputs", recording)
    refs = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    for batch in ([prompts[0]], prompts):  # one stream, then two sharing steps
        proposer = ReplayProposer(refs, acceptance, vocab, seed=2)
        bench._set_k(llm, 4, _Uneven(proposer) if uneven else proposer)
        outs = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want[: len(batch)]
        assert pre.armed is None
    if acceptance:
        assert pre.fired > 0  # the bet was taken and won
    assert len(fired_rows) == pre.fired
    if uneven:  # plain steps and two-draft steps ran in the armed graph of five rows' size
        assert {1, 3} <= {rows for rows, padded in fired_rows if rows < padded}
    # A paused stream's plain steps never take a verify graph: each bet lost was released.
    assert runner.graphs.replays >= pre.fired + pre.released
    llm.llm_engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prelaunched_verify_steps_keep_greedy_tokens() -> None:
    """On the GPU with the stream-side gate: the same speculating engine, the same replayed
    drafts, with and without the prelaunch, gives the same greedy tokens (the same verify
    steps in both runs, so 16-bit rounding cannot tell them apart), and the bets were taken
    and never left armed."""
    args = _args()
    args.device = "cuda"
    bench._default_model(args)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = bench._engine(args, 4)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = bench._prompts(1, 24, vocab)
    runner = llm.llm_engine.runner
    # Every step proposes: pauses follow step timings, which differ between the runs.
    llm.llm_engine.spec_decoder._update = lambda req, n: None
    assert not runner.set_prelaunch(False)
    first = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    runs = {}
    for on in (False, True):
        assert runner.set_prelaunch(on) == on
        bench._set_k(llm, 4, ReplayProposer({tuple(prompts[0]): first}, 0.7, vocab, seed=2))
        runs[on] = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
        if on:
            assert runner.prelaunch is not None and runner.prelaunch.fired > 0
            assert runner.prelaunch.armed is None
    assert runs[True] == runs[False]
    llm.llm_engine.shutdown()


def test_a_graph_that_fails_to_enqueue_leaves_the_gate_open() -> None:
    graphs = _Graphs()
    gate = HostGate()
    pre = GraphPrelaunch(graphs, gate)  # type: ignore[arg-type]

    def broken() -> None:
        raise RuntimeError("capture gone")

    graphs.graphs[(4, "a")] = SimpleNamespace(replay=broken)
    gate.enqueue = lambda work: work()  # type: ignore[method-assign]  # as a stream: now
    with pytest.raises(RuntimeError, match="capture gone"):
        pre.arm(4, "a")
    assert pre.armed is None and pre.released == 1
    ran: list[int] = []
    gate.enqueue = HostGate.enqueue.__get__(gate)  # type: ignore[method-assign]
    gate.enqueue(lambda: ran.append(1))
    assert ran == [1]  # nothing is held behind it


def test_runner_arms_and_releases_outside_inference_mode() -> None:
    """The engine arms and releases between steps, outside the runner's inference mode,
    and on the GPU the armed copy is enqueued then: it must not trip over inference
    tensors (the static inputs may be made under inference mode)."""
    from asyncengine.model_runner import ModelRunner

    graphs = _Graphs()
    with torch.inference_mode():
        graphs.static = torch.zeros(64, dtype=torch.uint8)

    class _AtOnce(HostGate):  # a stream enqueues at once: the copy runs at arm time
        def enqueue(self, work):  # type: ignore[no-untyped-def]
            work()

    runner = SimpleNamespace(prelaunch=GraphPrelaunch(graphs, _AtOnce()),  # type: ignore[arg-type]
                             _last_verify_graph=(8, "a"), draft_kv_cache=None)
    assert ModelRunner.prelaunch_next(runner)  # type: ignore[arg-type]
    assert graphs.replays == 1
    ModelRunner.release_prelaunch(runner)  # type: ignore[arg-type]
    assert runner.prelaunch.armed is None and runner.prelaunch.released == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_stream_gate_holds_work_until_opened() -> None:
    """The driver's side alone: work enqueued behind a closed gate has not run 50 ms later,
    and runs once the host writes the value (opened before any wait, so it cannot hang)."""
    import time

    from asyncengine.prelaunch import CudaStreamGate

    device = torch.device("cuda")
    x = torch.zeros(4, device=device)
    gate = CudaStreamGate(device)
    gate.close(1)
    x.add_(1)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    held = not done.query()
    gate.open(1)
    done.synchronize()
    assert held
    assert x.tolist() == [1.0] * 4
    gate.close(2)  # counts go on: 1 no longer opens it
    x.add_(1)
    done.record()
    time.sleep(0.05)
    held = not done.query()
    gate.open(2)
    torch.cuda.synchronize()
    assert held and x.tolist() == [2.0] * 4
