"""Speculative decoding, measured: acceptance and speedup on real weights (CPU), and the
verify step's mechanics on the 7B shape (GPU).

    # CPU, the embedded SmolLM2, n-gram drafts: an editing workload and open chat, each run
    # one request at a time with and without speculation (same requests, same run)
    python -m scripts.bench_spec_decode cpu

    # GPU, Llama-2-7B shape with dummy weights: verify-step cost for k = 1..8 against a
    # one-token step, ms per generated token at acceptance 0 / 0.5 / 0.7 / 0.9 (a replay
    # proposer drafting the target's own greedy output with controlled errors), and
    # throughput with and without speculation as the batch grows (W1-like decode)
    python -m scripts.bench_spec_decode gpu --shape llama2-7b

    # GPU, an A/B of settings in one process: one reference engine, then a speculating
    # engine per value (small graphs split after 0 or 2 layers), timing the swept k's only
    python -m scripts.bench_spec_decode gpu --brief --graph-head-layers 0 2

    # GPU, the draft model's cost: a Llama-160M-shape draft (dummy weights, Llama-2's
    # vocabulary) for the 7B shape, milliseconds per proposal of k drafts with the draft's
    # CUDA graphs and without (enforce_eager), at batch 1 and 8
    python -m scripts.bench_spec_decode draft

    # Any device, the host's part of a k = 4 verify step by part (one stream, fixed drafts).
    # Without a GPU the decode graphs replay eagerly: their static inputs, staging and
    # planning are the GPU's, so the layout and staging time is the path a GPU host runs
    python -m scripts.bench_spec_decode host --shape tiny

Each line of output is one JSON record.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import statistics
import time
from typing import Any

from asyncengine import LLM, SamplingParams
from asyncengine.request import Request
from asyncengine.spec_decode.metrics import SpecDecodingMetrics
from asyncengine.spec_decode.replay import ReplayProposer
from scripts.bench_common import common_prefix, emit

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip

PARAGRAPH = (
    "The city council met on Tuesday evening to discuss the new budget. After a long debate, "
    "the members agreed to increase funding for public libraries and to repair the old bridge "
    "over the river. The mayor thanked the residents who attended the meeting and promised "
    "that the next session would focus on transport and housing."
)
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''
EDITS = [
    f"Rewrite this paragraph exactly, but replace 'Tuesday' with 'Wednesday':\n\n{PARAGRAPH}",
    f"Give this text back unchanged except change 'old bridge' to 'stone bridge':\n\n{PARAGRAPH}",
    f"Return this Python code with the function `mean` renamed to `average` everywhere:\n\n{CODE}",
    f"Add a docstring to `variance` and return the whole file:\n\n{CODE}",
]
CHAT = [
    "What are three good habits for staying healthy?",
    "Write a short poem about the sea.",
    "Explain what a neural network is to a child.",
    "Give me some tips for learning a new language.",
]


def run_cpu(args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {"off": LLM(device="cpu"), "ngram": LLM(device="cpu", speculative_config=NGRAM)}
    for workload, prompts in (("edit", EDITS), ("chat", CHAT)):
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        # Alternating engines request by request, so load on a shared machine hits both alike.
        secs = dict.fromkeys(engines, 0.0)
        outs: dict[str, list] = {name: [] for name in engines}
        for llm in engines.values():
            llm.chat(msgs[0], params, use_tqdm=False)  # warm-up
            if llm.llm_engine.spec_decoder is not None:
                llm.llm_engine.spec_decoder.metrics = SpecDecodingMetrics(4)
        for m in msgs:
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs[name].append(llm.chat(m, params, use_tqdm=False)[0].outputs[0])
                secs[name] += time.perf_counter() - t0
        results: dict[str, Any] = {}
        for name, llm in engines.items():
            tokens = sum(len(o.token_ids) for o in outs[name])
            rec: dict[str, Any] = {"seconds": round(secs[name], 2), "tokens": tokens,
                                   "tokens_per_s": round(tokens / secs[name], 1)}  # fmt: skip
            dec = llm.llm_engine.spec_decoder
            if dec is not None:
                rec["acceptance_rate"] = round(dec.metrics.acceptance_rate, 3)
                rec["mean_acceptance_length"] = round(dec.metrics.mean_acceptance_length, 2)
                rec["verify_steps"] = dec.metrics.num_drafts
            results[name] = (rec, [o.token_ids for o in outs[name]])
        off, on = results["off"][0], results["ngram"][0]
        emit({
            "bench": "spec_decode_cpu", "workload": workload, "model": "SmolLM2-135M (embedded)",
            "speculative_config": NGRAM, "requests": len(prompts), "off": off, "ngram": on,
            "speedup": round(off["seconds"] / on["seconds"], 3),
            "greedy_outputs_equal": results["off"][1] == results["ngram"][1],
        })  # fmt: skip


class FixedDrafts:
    """Always `k` drafts (token 1): the verify step's cost, whatever is accepted."""

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        return [[1] * k for k in num_drafts]


def _engine(args: argparse.Namespace, k: int | None, head_layers: int = 0,
            **engine_args: Any) -> LLM:  # fmt: skip
    from asyncengine.model_runner import ModelRunner

    # Small decode graphs split after this many layers (the target's and the draft's; A/B).
    ModelRunner.graph_head_layers = head_layers
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
    return LLM(args.model, load_format=args.load_format, device=args.device,
               skip_tokenizer_init=True, speculative_config=spec,
               max_num_seqs=args.max_batch, enforce_eager=args.enforce_eager,
               **engine_args)  # fmt: skip


def _phases(llm: LLM, before: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step in each phase of `LLMEngine.step` since `before` (a copy of
    `step_timing`): where a step's wall time goes, host or device."""
    now = llm.llm_engine.step_timing
    steps = max(now["steps"] - before["steps"], 1)
    return {k.removesuffix("_s") + "_ms": round(1e3 * (now[k] - before[k]) / steps, 3)
            for k in now if k != "steps"}  # fmt: skip


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _set_k(llm: LLM, k: int, proposer: Any) -> None:
    """Speculate with k drafts from `proposer` from now on (one engine serves every k: a
    7B engine takes tens of seconds to build)."""
    dec = llm.llm_engine.spec_decoder
    dec.config = dataclasses.replace(dec.config, num_speculative_tokens=k)
    dec.metrics = SpecDecodingMetrics(k)
    dec.proposer = proposer


def _profile_verify(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, k: int = 4
) -> None:
    """GPU kernel time per verify step (k fixed drafts; k = 0: the one-token step) against its
    wall time, and the kernels that take it: what a step costs on the device, and what the
    host adds. The same prompts run once more to their first token only, and that profile's
    kernels are taken away, so the prompts' prefill does not count towards the steps."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _set_k(llm, k, FixedDrafts())

    def kernel_times(run_params: SamplingParams) -> tuple[dict[str, tuple[float, int]], float, int]:
        before = llm.llm_engine.step_timing["steps"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, run_params, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA}  # fmt: skip
        return kernels, wall, llm.llm_engine.step_timing["steps"] - before

    prefill, prefill_wall, prefill_steps = kernel_times(dataclasses.replace(params, max_tokens=1))
    full, wall, all_steps = kernel_times(params)
    steps = max(all_steps - prefill_steps, 1)
    per_step = {}
    for name, (us, count) in full.items():
        p_us, p_count = prefill.get(name, (0.0, 0))
        per_step[name] = ((us - p_us) / 1e3 / steps, (count - p_count) / steps)
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:16]
    emit({"bench": "spec_verify_profile", "k": k, "steps": steps,
          "wall_ms_per_step": round(1e3 * (wall - prefill_wall) / steps, 3),
          "gpu_kernel_ms_per_step": round(sum(ms for ms, _ in per_step.values()), 3),
          "kernels": [{"name": name[:60], "ms_per_step": round(ms, 4),
                       "calls_per_step": round(calls, 1)}
                      for name, (ms, calls) in top]})  # fmt: skip


def launch_gaps(events: list[tuple[str, str, float, float]]) -> dict[str, float | int]:
    """Where the device waits around graph launches, from a profile's events as (where,
    name, start us, end us), `where` "cpu" (runtime calls among them) or "gpu" (kernels and
    copies). For each `cudaGraphLaunch`: how long its call took the host, when the first
    kernel after the call's start began, from the call's start and from its end (negative:
    before the call returned), and how long the device had been idle before that kernel
    (since the end of every device event before it). Medians over the launches, in
    microseconds: whether a graph's work starts only once its launch call is done, and
    what the host costs a step it must wait for."""
    launches = sorted((s, e) for where, name, s, e in events
                      if where == "cpu" and name == "cudaGraphLaunch")  # fmt: skip
    device = sorted((s, e) for where, _, s, e in events if where == "gpu")
    calls, from_start, from_end, idle = [], [], [], []
    for s, e in launches:
        i = bisect.bisect_left(device, (s, float("-inf")))
        if i == len(device):
            continue
        k_start = device[i][0]
        busy_until = max((end for _, end in device[:i]), default=k_start)
        calls.append(e - s)
        from_start.append(k_start - s)
        from_end.append(k_start - e)
        idle.append(max(0.0, k_start - busy_until))
    if not calls:
        return {"launches": 0}
    med = statistics.median
    return {"launches": len(calls), "launch_call_us": round(med(calls), 1),
            "first_kernel_after_call_start_us": round(med(from_start), 1),
            "first_kernel_after_call_end_us": round(med(from_end), 1),
            "device_idle_before_us": round(med(idle), 1)}  # fmt: skip


def _profile_launch_gaps(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, k: int
) -> None:
    """`launch_gaps` of a stream of k-draft verify steps (fixed drafts; k = 0: plain
    one-token steps, which asynchronous scheduling launches before the previous resolves),
    from a torch profiler trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _set_k(llm, k, FixedDrafts())
    llm.generate(prompts, params, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = [("gpu" if e.device_type == DeviceType.CUDA else "cpu", e.name,
               e.time_range.start, e.time_range.end) for e in prof.events()]  # fmt: skip
    emit({"bench": "spec_launch_gaps", "k": k, **launch_gaps(events)})


def _replayed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams,
    references: dict[tuple[int, ...], list[int]], k: int, acceptance: float, seed: int,
    max_runs: int = 32,
) -> tuple[float, list, int, bool, list[int]]:  # fmt: skip
    """Time a run whose replay drafts come from the run's own greedy output.

    A verify step computes its rows at another row count than a one-token step (other
    kernels, other rounding), so in 16 bits a speculative run can leave the plain run's
    greedy path at a near tie, after which drafts replayed from the plain run are all wrong
    and the measurement shows divergence, not speculation. So the reference is the previous
    run's output, until a run reproduces the reference it drafted from: that run drafted the
    target's own greedy output with the set error rate, and it is the one timed. Each run
    reproduces its reference at least up to where the previous run left its own (the same
    drafts make the same verify steps there), so the agreed prefix grows run by run; it
    takes a run per divergence, which 16-bit rounding brings every 8-32 tokens. Returns
    (seconds, outputs, runs, converged, the shortest agreed prefix of each run)."""
    refs = dict(references)
    agreed: list[int] = []
    for run in range(1, max_runs + 1):
        _set_k(llm, k, ReplayProposer(refs, acceptance, llm.llm_engine.model_config.vocab_size,
                                      seed=seed))  # fmt: skip
        secs, outs = _timed(llm, prompts, params)
        produced = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}
        agreed.append(min(common_prefix(produced[p], refs[p]) for p in produced))
        if produced == refs:
            return secs, outs, run, True, agreed
        refs = produced
    return secs, outs, max_runs, False, agreed


def _host_split(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> None:
    """Host milliseconds per verify step (k = 4, fixed drafts) in each part of a step,
    timed by wrapping the engine's methods: what the host adds between two verify steps,
    which the device waits for (a verify step is resolved before the next is scheduled)."""
    import asyncengine.spec_decode.verify as verify_mod

    engine = llm.llm_engine
    runner = engine.runner
    parts = {
        "propose": (engine.spec_decoder, "propose"),
        "schedule": (engine.scheduler, "schedule"),
        "block_moves": (runner, "apply_block_moves"),
        "prepare_inputs": (runner, "prepare_inputs"),
        "run_model": (runner, "run_model"),
        "compute_logits": (runner.model, "compute_logits"),
        "launch_verify": (verify_mod, "launch_verify"),
        "resolve": (engine, "_resolve"),
    }
    spent = dict.fromkeys(parts, 0.0)
    originals = {name: getattr(obj, attr) for name, (obj, attr) in parts.items()}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    # With a prelaunched graph, the host's critical path: from a verdict reaching the host
    # to the next step's image going to the armed graph.
    from asyncengine.model_runner import InflightStep

    prelaunch = runner.prelaunch
    landed: list[float] = []
    to_fire: list[float] = []
    wait = InflightStep.wait

    def waited(step: InflightStep) -> None:
        wait(step)
        landed.append(time.perf_counter())

    _set_k(llm, 4, FixedDrafts())
    for name, (obj, attr) in parts.items():
        setattr(obj, attr, timed(name, originals[name]))
    InflightStep.wait = waited  # type: ignore[method-assign]
    if prelaunch is not None:
        fire = prelaunch.fire

        def fired(image: Any) -> None:
            to_fire.append(time.perf_counter() - landed[-1])
            fire(image)

        prelaunch.fire = fired  # type: ignore[method-assign]
    before = engine.step_timing["steps"]
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        InflightStep.wait = wait  # type: ignore[method-assign]
        if prelaunch is not None:
            del prelaunch.fire
        for name, (obj, attr) in parts.items():
            if obj is verify_mod:
                setattr(obj, attr, originals[name])
            else:
                delattr(obj, attr)  # the bound method comes back from the class
    steps = max(engine.step_timing["steps"] - before, 1)
    fire_ms = {}
    if to_fire:
        fire_ms = {"prelaunch_fired": len(to_fire),
                   "verdict_to_fire_ms": round(1e3 * statistics.median(to_fire), 3)}  # fmt: skip
    emit({"bench": "spec_verify_host", "k": 4, "steps": steps, **fire_ms,
          **{f"{n}_ms": round(1e3 * t / steps, 3) for n, t in spent.items()}})  # fmt: skip


class _EagerGraph:
    """Stands in for a captured decode graph off the GPU: `replay` runs the forward eagerly
    over the graphs' static inputs, planned as the graph would have been."""

    def __init__(self, graphs: Any, size: int, plan: Any) -> None:
        self.graphs, self.size, self.plan = graphs, size, plan

    def replay(self) -> None:
        from models.forward_context import set_forward_context

        g = self.graphs
        with set_forward_context(g._meta(self.size, self.plan)):
            out = g.model(g.input_ids[: self.size], g.positions[: self.size])
        g.outputs[self.size, self.plan] = out


def _eager_graphs(llm: LLM, max_blocks: int = 256) -> None:
    """Give the engine's runner decode graphs whose every (size, plan) replays eagerly."""
    from asyncengine.cuda_graphs import DecodeGraphs

    runner = llm.llm_engine.runner
    graphs = DecodeGraphs(runner.model, runner.device, llm.llm_engine.scheduler.max_num_seqs,
                          max_blocks, verify_rows=9)  # fmt: skip
    for size in graphs.sizes:
        for key in graphs.variants(size):
            graphs.graphs[key] = _EagerGraph(graphs, *key)  # type: ignore[assignment]
    runner.graphs = graphs


def run_host(args: argparse.Namespace) -> None:
    """Host milliseconds per k = 4 verify step by part, `--repeats` times; off the GPU
    through graphs that replay eagerly (`_eager_graphs`)."""
    _default_model(args)
    llm = _engine(args, 8, args.graph_head_layers)
    runner = llm.llm_engine.runner
    if runner.graphs is None:
        _eager_graphs(llm)
    if args.prelaunch:
        from asyncengine.prelaunch import GraphPrelaunch, HostGate

        # Off the GPU the gate is the host-side one: the same bookkeeping, no stream.
        if not runner.set_prelaunch(True):
            runner.prelaunch = GraphPrelaunch(runner.graphs, HostGate())
    llm.llm_engine.spec_decoder._update = lambda req, n: None  # keep proposing
    p1 = _prompts(1, args.prompt_len, llm.llm_engine.model_config.vocab_size)
    for _ in range(args.repeats):
        _host_split(llm, p1, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                            ignore_eos=True))  # fmt: skip
    llm.llm_engine.shutdown()


def run_host_profile(args: argparse.Namespace) -> None:
    """cProfile of the host over one stream of k-draft verify steps (fixed drafts, every step
    verifying), per k of `--profile-k`: which Python functions stand between a verdict and
    the next graph."""
    import cProfile
    import io
    import pstats

    _default_model(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = _engine(args, 8, args.graph_head_layers[0])
    llm.llm_engine.spec_decoder._update = lambda req, n: None  # keep proposing
    p1 = _prompts(1, args.prompt_len, llm.llm_engine.model_config.vocab_size)
    for k in args.profile_k:
        _set_k(llm, k, FixedDrafts())
        _timed(llm, p1, params)
        profile = cProfile.Profile()
        before = dict(llm.llm_engine.step_timing)
        profile.enable()
        secs, _ = _timed(llm, p1, params)
        profile.disable()
        steps = max(llm.llm_engine.step_timing["steps"] - before["steps"], 1)
        emit({"bench": "spec_host_profile", "k": k,
              "ms_per_step_profiled": round(1e3 * secs / steps, 3), **_phases(llm, before)})
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
            print(text.getvalue())
    llm.llm_engine.shutdown()


def _default_model(args: argparse.Namespace) -> None:
    """Without --model: dummy weights of the --shape architecture."""
    if args.model is None:
        from scripts.bench_common import dummy_model_dir

        args.model, args.load_format = str(dummy_model_dir(args.shape)), "dummy"


# Latency runs (k, acceptance): k = 4 at every acceptance (the target is at 0.7);
# k = 2 and 6 where they may pay more.
DEFAULT_SWEEP = [(4, 0.0), (4, 0.5), (4, 0.7), (4, 0.9), (2, 0.7), (6, 0.7), (6, 0.9)]


def _k_acceptance(text: str) -> tuple[int, float]:
    k, _, acceptance = text.partition(":")
    try:
        pair = int(k), float(acceptance)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want K:ACCEPTANCE, e.g. 4:0.7; got {text!r}") from None
    if not 1 <= pair[0] <= 16 or not 0.0 <= pair[1] <= 1.0:
        raise argparse.ArgumentTypeError(f"k in 1-16 and acceptance in 0-1; got {text!r}")
    return pair


def run_gpu(args: argparse.Namespace) -> None:
    """The one-token step and the references without speculation (one engine, graphs split
    as the first --graph-head-layers value says), then per --graph-head-layers value a
    speculating engine's verify steps, latency sweep and batches (`_spec_runs`): an A/B of
    split graphs needs one reference engine and one process."""
    _default_model(args)
    prompt_len, out_len = args.prompt_len, args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)

    # Without speculation: the one-token step, and every reference output the replay drafts
    # come from (one stream, then each batch), with each batch's throughput.
    base = _engine(args, None, args.graph_head_layers[0])
    vocab = base.llm_engine.model_config.vocab_size
    p1 = _prompts(1, prompt_len, vocab)
    _timed(base, p1, params)
    secs, outs = _timed(base, p1, params)
    one_token_ms = 1e3 * secs / out_len
    # Each engine tunes its matmul plans at start, and they differ run to run: recorded so
    # that a slow engine can be told from a slow machine.
    from models.linear_tuning import describe_matmul_plans

    emit({"bench": "spec_verify_step", "k": 0, "graph_head_layers": args.graph_head_layers[0],
          "ms_per_step": round(one_token_ms, 3),
          "matmul_plans": describe_matmul_plans(base.llm_engine.runner.model)})
    reference = {tuple(p1[0]): outs[0].outputs[0].token_ids}
    batches = {}
    for batch in args.batches:
        ps = _prompts(batch, prompt_len, vocab, seed=batch)
        secs_off, outs = _timed(base, ps, params)
        refs = {tuple(p): o.outputs[0].token_ids for p, o in zip(ps, outs, strict=True)}
        batches[batch] = (ps, refs, secs_off)
    base.llm_engine.shutdown()
    del base
    if not args.brief:
        # The same step resolved before the next is scheduled, as a verify step is: the
        # host's share of a step that cannot overlap.
        sync = _engine(args, None, args.graph_head_layers[0], async_scheduling=False)
        _timed(sync, p1, params)
        before = dict(sync.llm_engine.step_timing)
        secs, _ = _timed(sync, p1, params)
        emit({"bench": "spec_verify_step", "k": 0, "sync": True,
              "ms_per_step": round(1e3 * secs / out_len, 3), **_phases(sync, before)})
        sync.llm_engine.shutdown()
        del sync
    # The speculating engines after the first take its matmul plans: each engine's start-up
    # tuning plans anew, and plans that differ would be part of an A/B's difference.
    plans = None
    for head_layers in args.graph_head_layers:
        plans = _spec_runs(args, head_layers, p1, reference, batches, one_token_ms, plans)


def _plans_of(llm: LLM) -> dict[str, Any]:
    """Every planned matmul layer's plan, by the layer's name."""
    from models.matmul_plan import PlannedMatmul

    model = llm.llm_engine.runner.model
    return {name: m.plan for name, m in model.named_modules() if isinstance(m, PlannedMatmul)}


def _adopt_plans(llm: LLM, plans: dict[str, Any]) -> None:
    """Give `llm`'s layers `plans` (`_plans_of` another engine of the same model), then
    capture its CUDA graphs again with them (on the GPU)."""
    engine = llm.llm_engine
    for name, m in engine.runner.model.named_modules():
        if name in plans:
            m.set_plan(plans[name])
    if engine.runner.device.type == "cuda":
        spec = engine.spec_decoder
        engine.runner.prepare_for_serving(
            enforce_eager=engine.runner.graphs is None,
            max_num_seqs=engine.scheduler.max_num_seqs,
            max_blocks_per_seq=engine.pool.blocks_needed(engine.max_model_len),
            verify_rows=0 if spec is None else spec.max_verify_rows,
        )  # fmt: skip


def _spec_runs(
    args: argparse.Namespace, head_layers: int, p1: list[list[int]],
    reference: dict[tuple[int, ...], list[int]],
    batches: dict[int, tuple[list[list[int]], dict[tuple[int, ...], list[int]], float]],
    one_token_ms: float, plans: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`run_gpu`'s speculating engine with small graphs split after `head_layers` layers (and
    the matmul `plans` of an earlier such engine, if given): verify steps (and, unless
    --brief, where their time goes), the latency sweep and the batches against `run_gpu`'s
    references; every record names `graph_head_layers`. Returns the engine's plans."""
    from models.linear_tuning import describe_matmul_plans

    out_len = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm = _engine(args, 8, head_layers)
    if plans is not None:
        _adopt_plans(llm, plans)
    split = {"graph_head_layers": head_layers, "plans_of_first_engine": plans is not None}
    emit({"bench": "spec_matmul_plans", **split,
          "matmul_plans": describe_matmul_plans(llm.llm_engine.runner.model)})
    dec = llm.llm_engine.spec_decoder
    adaptive_update = dec._update
    runner = llm.llm_engine.runner
    # Each --prelaunch value times the verify steps and the sweep again on this engine.
    for prelaunch in map(bool, args.prelaunch):
        if runner.set_prelaunch(prelaunch) != prelaunch:
            emit({"bench": "spec_prelaunch_unavailable", **split})
            continue
        _verify_and_latency(args, llm, p1, reference, one_token_ms,
                            {**split, "prelaunch": prelaunch}, adaptive_update)  # fmt: skip
    runner.set_prelaunch(runner.prelaunch_verify)  # the rest as the engine runs
    dec._update = adaptive_update

    # 3. Under load: throughput as the batch grows, acceptance 0.7, k = 4 (turned down by
    # the batch size as the engine does).
    for batch, (ps, refs, secs_off) in batches.items():
        secs_on, outs, runs, converged, _ = _replayed(llm, ps, params, refs, 4, 0.7, 2, 3)
        k_used = dec.config.num_drafts_for_batch(batch)
        emit({"bench": "spec_throughput", "batch": batch, "k_used": k_used, **split,
              "tokens_per_s_off": round(batch * out_len / secs_off, 1),
              "tokens_per_s_on": round(batch * out_len / secs_on, 1),
              "ratio": round(secs_off / secs_on, 3), "replay_runs": runs,
              "replay_converged": converged,
              "equal_to_plain": all(o.outputs[0].token_ids == refs[tuple(p)]
                                    for p, o in zip(ps, outs, strict=True))})  # fmt: skip
    mine = _plans_of(llm)
    llm.llm_engine.shutdown()
    return mine


def _verify_and_latency(
    args: argparse.Namespace, llm: LLM, p1: list[list[int]],
    reference: dict[tuple[int, ...], list[int]], one_token_ms: float, split: dict[str, Any],
    adaptive_update: Any,
) -> None:  # fmt: skip
    """`_spec_runs`' verify steps (and, unless --brief, where their time goes) and latency
    sweep on one engine; every record carries `split`."""
    out_len = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    vocab = llm.llm_engine.model_config.vocab_size
    dec = llm.llm_engine.spec_decoder
    # 1. Verify-step cost: one request, k fixed drafts every step (nothing adaptive).
    dec._update = lambda req, n: None  # keep proposing: the cost of every verify step
    for k in sorted({k for k, _ in args.sweep}) if args.brief else range(1, 9):
        _set_k(llm, k, FixedDrafts())
        _timed(llm, p1, params)
        before = dict(llm.llm_engine.step_timing)
        secs, _ = _timed(llm, p1, params)
        steps = llm.llm_engine.step_timing["steps"] - before["steps"]
        emit({"bench": "spec_verify_step", "k": k, **split,
              "ms_per_step": round(1e3 * secs / steps, 3),
              "vs_one_token_step": round(1e3 * secs / steps / one_token_ms, 3),
              **_phases(llm, before)})  # fmt: skip
    if not args.brief:  # where the time goes: kernels, host parts, launch gaps
        for k in (0, 4):  # the one-token step's kernels beside the verify step's
            _profile_verify(llm, p1, SamplingParams(temperature=0, max_tokens=32,
                                                    ignore_eos=True), k)  # fmt: skip
        _host_split(llm, p1, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for k in (4, 0):
            _profile_launch_gaps(llm, p1, SamplingParams(temperature=0, max_tokens=64,
                                                         ignore_eos=True), k)  # fmt: skip
    dec._update = adaptive_update

    # 2. Latency per generated token (L1-like, one stream) at controlled acceptance.
    plain = reference[tuple(p1[0])]
    # Each point (`--sweep`) replays until its run converges (up to 32 runs).
    for k, acceptance in args.sweep:
        _set_k(llm, k, ReplayProposer(reference, acceptance, vocab, seed=1))
        _timed(llm, p1, params)  # warm-up
        steps0 = llm.llm_engine.step_timing["steps"]
        secs, outs, runs, converged, agreed = _replayed(llm, p1, params, reference, k,
                                                        acceptance, 1)  # fmt: skip
        out = outs[0].outputs[0].token_ids
        # of the timed run (`_set_k` resets the metrics before each run)
        timed_run = {"mean_acceptance_length": round(dec.metrics.mean_acceptance_length, 3),
                     "verify_steps": dec.metrics.num_drafts}  # fmt: skip
        steps_all = llm.llm_engine.step_timing["steps"] - steps0
        # The converged run again (the same drafts, so the same steps): the median of its
        # times, since one run varies by a few percent from call to call.
        times = [secs]
        for _ in range(args.repeats if converged else 0):
            _set_k(llm, k, ReplayProposer({tuple(p1[0]): out}, acceptance, vocab, seed=1))
            again, outs_again = _timed(llm, p1, params)
            if outs_again[0].outputs[0].token_ids == out:
                times.append(again)
        secs = statistics.median(times)
        emit({"bench": "spec_latency", "k": k, "acceptance": acceptance, **split,
              "ms_per_token": round(1e3 * secs / out_len, 3),
              "ms_per_token_runs": [round(1e3 * t / out_len, 3) for t in times],
              "baseline_ms_per_token": round(one_token_ms, 3),
              "speedup": round(one_token_ms * out_len / 1e3 / secs, 3),
              **timed_run, "replay_runs": runs, "replay_converged": converged,
              "agreed_prefix_by_run": agreed,
              # and the steps of every replay run
              "steps_all_runs": steps_all,
              "cost_ratio": round(dec.cost.ratio, 3),
              "left_plain_greedy_at": None if out == plain else common_prefix(out, plain)})



def run_draft(args: argparse.Namespace) -> None:
    """Milliseconds per proposal (the draft's catch-up forward, then k - 1 one-token steps)
    with the draft's steps in CUDA graphs and eagerly, the same requests each time, every
    step proposing. Dummy weights accept next to nothing, so this times the draft's work
    alone (a catch-up of one token, then k - 1 steps): each proposal is timed by itself
    (the device synchronized around it), and the median reported, which the catch-up of a
    fresh prompt does not move."""

    import torch

    from scripts.bench_common import dummy_model_dir

    target, draft = dummy_model_dir(args.shape), dummy_model_dir(args.draft_shape)
    spec = {"model": str(draft), "load_format": "dummy", "num_speculative_tokens": args.k,
            "max_draft_tokens_per_step": args.k * max(args.batches)}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    from asyncengine.model_runner import ModelRunner

    runs = [(False, h) for h in args.graph_head_layers]
    runs += [(True, 0)] * (not args.no_eager)
    for eager, head_layers in runs:
        ModelRunner.graph_head_layers = head_layers  # the draft's graphs split as the target's
        llm = LLM(str(target), load_format="dummy", skip_tokenizer_init=True,
                  speculative_config=spec, enforce_eager=eager,
                  max_num_seqs=max(args.batches))  # fmt: skip
        decoder = llm.llm_engine.spec_decoder
        # Dummy weights accept nothing, and a request whose drafts keep failing pauses; the
        # pause is switched off so that every step proposes and the median is of many.
        decoder._update = lambda req, num_accepted: None
        proposer = decoder.proposer
        timings: list[float] = []
        propose = proposer.propose

        def timed(requests: Any, num_drafts: Any, propose: Any = propose,
                  timings: list[float] = timings) -> Any:  # fmt: skip
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = propose(requests, num_drafts)
            torch.cuda.synchronize()
            timings.append(time.perf_counter() - t0)
            return out

        proposer.propose = timed
        for batch in args.batches:
            timings.clear()
            llm.generate(_prompts(batch, args.prompt_len, args.vocab), params, use_tqdm=False)
            ms = 1e3 * statistics.median(timings) if timings else None
            emit({"bench": "draft proposal", "draft_graphs": not eager,
                  "graph_head_layers": head_layers, "batch": batch,
                  "k": args.k, "target": args.shape, "draft": args.draft_shape,
                  "proposals": len(timings), "ms_per_proposal": ms,
                  "graph_replays": 0 if proposer.graphs is None else proposer.graphs.replays})
        llm.llm_engine.shutdown()


def _engine_flags(parser: argparse.ArgumentParser, shape: str, prompt_len: int) -> None:
    """The flags of the modes that build one engine on a dummy-weight shape (`_engine`)."""
    parser.add_argument("--shape", default=shape)
    parser.add_argument("--model", default=None, help="a model directory instead of --shape")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="n-gram on the embedded SmolLM2, CPU")
    cpu.add_argument("--max-tokens", type=int, default=160)
    gpu = sub.add_parser("gpu", help="verify-step mechanics on a dummy-weight shape")
    _engine_flags(gpu, "llama2-7b", prompt_len=128)
    gpu.add_argument("--vocab", type=int, default=32000)
    gpu.add_argument("--graph-head-layers", type=int, nargs="+", default=[0],
                     help="one speculating engine per value, its small decode graphs split "
                          "after that many layers (0: whole); the references and the "
                          "one-token step come from one engine split as the first value says")
    gpu.add_argument("--prelaunch", type=int, nargs="+", choices=(0, 1), default=[1],
                     help="time the verify steps and the sweep once per value on each "
                          "speculating engine: 1 (the engine's default) enqueues the next "
                          "verify step's graph behind a gate before the verdict "
                          "(asyncengine.prelaunch)")
    gpu.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    gpu.add_argument("--sweep", type=_k_acceptance, nargs="+", default=DEFAULT_SWEEP,
                     help="latency runs as K:ACCEPTANCE (default: %(default)s)")
    gpu.add_argument("--repeats", type=int, default=4,
                     help="latency: times the converged run this many more times (median)")
    gpu.add_argument("--brief", action="store_true",
                     help="only the verify steps of the --sweep draft counts and the sweep "
                          "itself: no synchronous engine, profiles or host split (an A/B of "
                          "settings in a short device call)")
    gpu.add_argument("--host-profile", action="store_true",
                     help="only profile the host's part of verify steps (cProfile)")
    gpu.add_argument("--profile-k", type=int, nargs="+", default=[4],
                     help="draft counts --host-profile profiles, one after another")
    gpu.add_argument("--top", type=int, default=30, help="functions listed per profile order")
    host = sub.add_parser("host", help="the host's part of a verify step, any device")
    _engine_flags(host, "tiny", prompt_len=64)
    host.add_argument("--repeats", type=int, default=3)
    host.add_argument("--prelaunch", action="store_true",
                      help="bet on every verify step (asyncengine.prelaunch) and report the "
                           "host's path from a verdict to the armed graph's inputs")
    host.add_argument("--graph-head-layers", type=int, default=0,
                      help="split small decode graphs after this many layers (0: whole)")
    draft = sub.add_parser("draft", help="the draft model's cost per proposal, graphs or not")
    draft.add_argument("--shape", default="llama2-7b")
    draft.add_argument("--draft-shape", default="llama-160m")
    draft.add_argument("--k", type=int, default=4)
    draft.add_argument("--vocab", type=int, default=32000)
    draft.add_argument("--prompt-len", type=int, default=128)
    draft.add_argument("--max-tokens", type=int, default=64)
    draft.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    draft.add_argument("--graph-head-layers", type=int, nargs="+", default=[0],
                       help="with graphs, one run per value: small graphs split after that "
                            "many layers (0: whole)")
    draft.add_argument("--no-eager", action="store_true", help="skip the run without graphs")
    args = parser.parse_args()
    if args.mode == "cpu":
        run_cpu(args)
    elif args.mode == "draft":
        run_draft(args)
    elif args.mode == "host":
        run_host(args)
    elif args.host_profile:
        run_host_profile(args)
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
