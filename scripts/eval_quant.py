"""Q1 of BENCHMARKS.md: what a weight format costs in accuracy, on the CPU path.

For each quantized checkpoint of a model: the perplexity over a fixed text shipped in the
repository (tests/data/eval_text.txt, in windows of `--window` tokens) beside the 16-bit
model's, and the greedy agreement with the 16-bit model (the share of generated tokens equal
position by position, and the mean length of the common prefix) over prompts cut from the
same text. Prints one JSON line per model and a markdown table (docs/quantization.md).

  python scripts/eval_quant.py --checkpoint gptq-4=/path/to/gptq --checkpoint awq-4=/path/awq
  python scripts/eval_quant.py --rtn gptq-4-g64,awq-4-g64 --out /tmp/q1   # round-to-nearest

`--base` defaults to the embedded SmolLM2-135M. `--rtn` writes round-to-nearest checkpoints
with the test-fixture writer (tests/quant_writers.py): an accuracy floor for the format's
conventions, not what GPTQ or AWQ calibration reaches.
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


def perplexity(model_dir: Path, tokens: list[int], window: int = 256) -> float:
    """exp(mean NLL) over `tokens` in consecutive windows (each predicts its own tokens 2..)."""
    from models.config import ModelConfig
    from models.loader import load_model

    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, dtype=torch.float32, device=torch.device("cpu"))
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


def greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
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
    compressed-tensors-4-g64 (sym implied) or compressed-tensors-8-channel."""
    from tests.quant_writers import Scheme, write_quantized

    made = {}
    for name in names:
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
    args = ap.parse_args()
    if args.base is None:
        from models.default_model import default_model_dir

        args.base = default_model_dir()
    models = {"16-bit": args.base}
    for item in args.checkpoint:
        name, _, path = item.partition("=")
        models[name] = Path(path)
    if args.rtn:
        models.update(rtn_checkpoints(args.base, args.rtn.split(","), args.out))
    tokens = eval_tokens(args.base)
    prompts = prompts_from(tokens)
    rows = []
    base_ppl, base_out = None, None
    for name, path in models.items():
        ppl = perplexity(path, tokens, args.window)
        out = greedy(path, prompts, args.max_tokens)
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
