"""Q1 of BENCHMARKS.md: what a weight format costs in accuracy, on the CPU path.

For each quantized checkpoint of a model: the perplexity over a fixed text shipped in the
repository (tests/data/eval_text.txt, in windows of `--window` tokens) beside the 16-bit
model's, and the greedy agreement with the 16-bit model (the share of generated tokens equal
position by position, and the mean length of the common prefix) over prompts cut from the
same text. Prints one JSON line per model and a markdown table (docs/quantization.md).

  python scripts/eval_quant.py --checkpoint gptq-4=/path/to/gptq --checkpoint awq-4=/path/awq
  python scripts/eval_quant.py --rtn gptq-4-g64,awq-4-g64 --out /tmp/q1   # round-to-nearest
  python scripts/eval_quant.py --fp8 --rtn fp8-tensor                     # FP8 weights

`--base` defaults to the embedded SmolLM2-135M. `--rtn` writes round-to-nearest checkpoints
with the test-fixture writer (tests/quant_writers.py): an accuracy floor for the format's
conventions, not what GPTQ or AWQ calibration reaches.

`--fp8` adds the base model quantized at load (`quantization="fp8"`: per-channel e4m3
weights) twice: on the CPU's W8A8 reference (activations rounded to e4m3 per token, as the
GPU's GEMMs compute) and weight-only (W8A16, as the GPU's GEMV for 1-16 rows computes).
`--rtn fp8-tensor` writes a vLLM-style FP8 checkpoint with one weight scale per tensor.
A `--checkpoint` name ending in "W8A16" is evaluated weight-only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVAL_TEXT = ROOT / "tests" / "data" / "eval_text.txt"
BLOCK = 16


def eval_tokens(base_dir: Path, text_path: Path = EVAL_TEXT) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    return tok(text_path.read_text(), add_special_tokens=False)["input_ids"]


def _window_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one sequence as one prefill step through a fresh paged cache."""
    from models.forward_context import AttentionMetadata, set_forward_context

    blocks = -(-len(ids) // BLOCK)
    for attn in model.attention_layers():  # type: ignore[operator]
        shape = (blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(ids)),
        query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
    )
    with torch.inference_mode(), set_forward_context(meta):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden).float()  # type: ignore[operator]


def perplexity(model_dir: Path, tokens: list[int], window: int = 256,
               quantization: str | None = None, weight_only: bool = False) -> float:  # fmt: skip
    """exp(mean NLL) over `tokens` in consecutive windows (each predicts its own tokens 2..).
    quantization: the engine's `quantization=`; weight_only: FP8 layers on the W8A16
    reference."""
    from models.config import ModelConfig
    from models.loader import load_model
    from models.quantization.fp8 import use_weight_only_reference

    cfg = ModelConfig.from_dir(model_dir, quantization)
    model = load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))
    if weight_only:
        use_weight_only_reference(model)
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        ids = tokens[start : start + window]
        if len(ids) < 2:
            break
        logits = _window_logits(model, ids)
        target = torch.tensor(ids[1:])
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


def greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int,
    quantization: str | None = None, weight_only: bool = False,
) -> list[list[int]]:  # fmt: skip
    from asyncengine import LLM, SamplingParams
    from models.quantization.fp8 import use_weight_only_reference

    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
              quantization=quantization)  # fmt: skip
    try:
        if weight_only:
            use_weight_only_reference(llm.llm_engine.runner.model)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Share of positions with the same token, and the mean common-prefix length."""
    same = total = prefix = 0
    for a, b in zip(base, other, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
        run = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix += run
    return {"token_agreement": same / total, "mean_common_prefix": prefix / len(base)}


def prompts_from(tokens: list[int], count: int = 8, length: int = 24) -> list[list[int]]:
    step = max((len(tokens) - length) // count, 1)
    return [tokens[i * step : i * step + length] for i in range(count)]


def rtn_checkpoints(base: Path, names: list[str], out: Path) -> dict[str, Path]:
    """Round-to-nearest checkpoints named like gptq-4-g64, gptq-8-g64-sym, awq-4-g64,
    compressed-tensors-4-g64 (sym implied), compressed-tensors-8-channel, or FP8 e4m3 with
    dynamic activations: fp8-tensor (vLLM-style, a scale per tensor), ct-fp8-channel
    (compressed-tensors float-quantized, a scale per channel)."""
    from tests.quant_writers import FP8_METHODS, Scheme, write_quantized

    made = {}
    for name in names:
        method, _, strategy = name.rpartition("-")
        if method in FP8_METHODS:
            made[f"{name} (RTN)"] = out / name
            write_quantized(base, out / name, Scheme(method, fp8_weights=strategy))
            continue
        parts = name.split("-")
        method = "compressed-tensors" if name.startswith("compressed-tensors") else parts[0]
        rest = name.removeprefix(method + "-").split("-")
        bits = int(rest[0])
        group = -1 if rest[1] == "channel" else int(rest[1].removeprefix("g"))
        sym = "sym" in rest or method == "compressed-tensors"
        scheme = Scheme(method, bits, group, sym=sym, desc_act="act" in rest)
        made[f"{name} (RTN)"] = out / name
        write_quantized(base, out / name, scheme)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", type=Path, help="16-bit model dir (default: the embedded model)")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--rtn", default="", help="comma-separated RTN schemes to write and evaluate")
    ap.add_argument("--out", type=Path, default=Path("/tmp/asyncengine-q1"))
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fp8", action="store_true", help="add the base quantized to FP8 at load")
    args = ap.parse_args()
    if args.base is None:
        from models.default_model import default_model_dir

        args.base = default_model_dir()
    # name -> (directory, quantization=, weight-only FP8 reference)
    models: dict[str, tuple[Path, str | None, bool]] = {"16-bit": (args.base, None, False)}
    for item in args.checkpoint:
        name, _, path = item.partition("=")
        models[name] = (Path(path), None, name.endswith("W8A16"))
    if args.fp8:
        models["fp8 at load, W8A8 (per-token)"] = (args.base, "fp8", False)
        models["fp8 at load, W8A16"] = (args.base, "fp8", True)
    if args.rtn:
        for name, path in rtn_checkpoints(args.base, args.rtn.split(","), args.out).items():
            models[name] = (path, None, False)
    tokens = eval_tokens(args.base)
    prompts = prompts_from(tokens)
    rows = []
    base_ppl, base_out = None, None
    for name, (path, quantization, weight_only) in models.items():
        ppl = perplexity(path, tokens, args.window, quantization, weight_only)
        out = greedy(path, prompts, args.max_tokens, quantization, weight_only)
        base_ppl, base_out = base_ppl or ppl, base_out or out
        row = {"model": name, "perplexity": round(ppl, 3),
               "ppl_increase": round(ppl / base_ppl - 1, 4),
               **{k: round(v, 3) for k, v in agreement(base_out, out).items()}}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{len(tokens)} tokens, windows of {args.window}; greedy: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens\n")  # fmt: skip
    print("| format | perplexity | increase | token agreement | mean common prefix |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['perplexity']:.3f} | {100 * r['ppl_increase']:+.2f} % | "
              f"{100 * r['token_agreement']:.1f} % | {r['mean_common_prefix']:.1f} |")


if __name__ == "__main__":
    main()
