"""`LLM`: offline batched generation, as `vllm.LLM`, on top of `LLMEngine`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from asyncengine.config import EngineArgs
from asyncengine.llm_engine import LLMEngine
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Offline generation. `model=None` loads the embedded default model."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Free the KV pools, CUDA graphs and weights now; the `LLM` generates no more.
        Also done on leaving a `with` block. Dropping the `LLM` frees the same memory at once
        (no reference cycle holds it), unless its `llm_engine` is still held elsewhere."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        A prompt the engine refuses raises its `RequestError` (a ValueError: too long, empty,
        bad token ids or parameters) before anything runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_for(len(prompts), sampling_params)
        return self._run([(p, None) for p in prompts], params_list, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied)."""
        convs: list[Messages] = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item,arg-type]
        )
        ids = [self.llm_engine.apply_chat_template(c) for c in convs]
        params_list = self._params_for(len(convs), sampling_params)
        return self._run([(None, i) for i in ids], params_list, use_tqdm)

    @staticmethod
    def _params_for(
        n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(
        self,
        items: list[tuple[Prompt | None, list[int] | None]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for (prompt, ids), params in zip(items, params_list, strict=True):
                if params.output_kind != RequestOutputKind.FINAL_ONLY:
                    params = _final_only(params)
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, prompt, params, prompt_token_ids=ids)
                order[rid] = len(order)
        except BaseException:
            # A refused prompt (a `RequestError`) must not leave the earlier ones queued.
            engine.abort_request(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(
            total=len(order),
            desc="Processed prompts",
            unit="req",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        start = time.monotonic()
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                for _, _, exc in engine.take_rejected():  # a grammar that failed to compile
                    raise exc
                for out in outputs:
                    if not out.finished:
                        continue
                    results[order[out.request_id]] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.monotonic() - start, 1e-9)
                    rates = (in_tokens / elapsed, out_tokens / elapsed)
                    bar.set_postfix_str("in: {:.0f} tok/s, out: {:.0f} tok/s".format(*rates))
                    bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]


def _final_only(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
