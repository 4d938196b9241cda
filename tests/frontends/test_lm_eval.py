"""lm-evaluation-harness against `asyncengine serve`, as a user runs it: `lm_eval --model
local-completions` on the embedded model (CPU) with the tasks shipped in
scripts/lm_eval_tasks, offline (nothing is downloaded: the tokenizer is the model's own
directory, the data local JSON files). Each answer's loglikelihood equals the offline engine's
prompt logprobs; the accuracy equals what HF's logits give on the same items; the generated
answers equal the offline engine's greedy ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
import torch

from asyncengine import LLM, SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "scripts" / "lm_eval_tasks"
MODEL = "smollm2"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_lm_eval(port: int, model_dir: Path, out: Path, tmp: Path) -> str:
    args = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", f"base_url=http://127.0.0.1:{port}/v1/completions,"
        f"tokenizer={model_dir},tokenizer_backend=huggingface,model={MODEL},"
        "num_concurrent=1,max_retries=1",
        "--tasks", "asyncengine_capitals,asyncengine_arithmetic",
        "--include_path", str(TASKS), "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp / "datasets")}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def lm_eval_run(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], str]:
    """Serve the embedded model, run lm_eval against it; its results, samples and log."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontends.cli", "serve", "--device", "cpu", "--dtype",
         "float32", "--max-model-len", "512", "--num-kv-blocks", "128", "--enforce-eager",
         "--port", "0", "--openai-port", str(port), "--served-model-name", MODEL],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        log = run_lm_eval(port, default_model_dir, tmp / "out", tmp)
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    [results_file] = (tmp / "out").rglob("results_*.json")
    samples = {
        task: [json.loads(line) for line in next((tmp / "out").rglob(f"samples_{task}_*.jsonl"))
               .read_text().splitlines()]
        for task in ("asyncengine_capitals", "asyncengine_arithmetic")
    }  # fmt: skip
    return json.loads(results_file.read_text())["results"], samples, log


@pytest.fixture(scope="module")
def offline_llm() -> Any:
    llm = LLM(dtype="float32", device="cpu")
    yield llm
    llm.llm_engine.shutdown()


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """lm_eval's causal split: the whole text's ids and how many belong to the context."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    return whole, len(tok.encode(context, add_special_tokens=False))


def test_loglikelihoods_equal_the_engines_and_accuracy_equals_hfs(
        lm_eval_run: Any, offline_llm: LLM, default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    results, samples, log = lm_eval_run
    assert "Downloading" not in log
    llm = offline_llm
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    items = samples["asyncengine_capitals"]
    assert len(items) == 10
    pairs = [(s["arguments"][f"gen_args_{j}"]["arg_0"], s["arguments"][f"gen_args_{j}"]["arg_1"])
             for s in items for j in range(len(s["doc"]["choices"]))]  # fmt: skip
    encoded = [encode_pair(tok, ctx, cont) for ctx, cont in pairs]
    outs = llm.generate([ids for ids, _ in encoded],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = [sum(e[t].logprob for t, e in zip(ids[n:], out.prompt_logprobs[n:], strict=True))
            for (ids, n), out in zip(encoded, outs, strict=True)]  # fmt: skip
    served = [float(r[0][0]) for s in items for r in s["resps"]]
    assert served == pytest.approx(ours, abs=1e-4)
    with torch.inference_mode():
        theirs = []
        for ids, n in encoded:
            lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            theirs.append(float(sum(lps[i - 1, ids[i]] for i in range(n, len(ids)))))
    assert ours == pytest.approx(theirs, abs=1e-3)
    correct, at = 0, 0
    for s in items:
        k = len(s["doc"]["choices"])
        scores = theirs[at : at + k]
        correct += scores.index(max(scores)) == s["doc"]["answer"]
        at += k
    assert results["asyncengine_capitals"]["acc,none"] == pytest.approx(correct / len(items))


def test_generated_answers_equal_the_offline_engines(lm_eval_run: Any,
                                                     offline_llm: LLM) -> None:
    results, samples, _ = lm_eval_run
    items = samples["asyncengine_arithmetic"]
    assert len(items) == 6
    llm = offline_llm
    tok = llm.get_tokenizer()
    prompts = [tok.encode(s["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False)
               for s in items]  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, stop=["\n"]),
                        use_tqdm=False)
    assert [s["resps"][0][0] for s in items] == [o.outputs[0].text for o in outs]
    match = sum(s["filtered_resps"][0] == s["target"] for s in items) / len(items)
    assert results["asyncengine_arithmetic"]["exact_match,strip"] == pytest.approx(match)
