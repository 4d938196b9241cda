"""Q1 of BENCHMARKS.md: what a weight format costs in accuracy, through the engine itself.

For each quantized checkpoint of a model: the perplexity over a fixed text shipped in the
repository (tests/data/eval_text.txt, in windows of `--window` tokens) beside the 16-bit
model's, and the greedy agreement with the 16-bit model (the share of generated tokens equal
position by position, and the mean length of the common prefix) over prompts cut from the
same text. Prints one JSON line per model and a markdown table (docs/quantization.md).

Both come from the engine (`LLM`): the perplexity from its prompt logprobs
(`SamplingParams(prompt_logprobs=0)`, each window a prompt), not a separate forward, so a
row measures what the engine serves: the torch reference path on the CPU (`--device cpu`,
the default, float32), each format's real kernels on a GPU (`--device cuda`, the
checkpoint's dtype unless `--dtype`).

  python scripts/eval_quant.py --checkpoint gptq-4=/path/to/gptq --checkpoint awq-4=/path/awq
  python scripts/eval_quant.py --rtn gptq-4-g64,awq-4-g64 --out /tmp/q1   # round-to-nearest
  python scripts/eval_quant.py --kv-cache-dtype fp8 --kv-scales default,one,head  # FP8 KV
  python scripts/eval_quant.py --fp8 --rtn fp8-tensor                     # FP8 weights
  python scripts/eval_quant.py --device cuda --fp8 --kv-cache-dtype fp8   # GPU kernels

`--base` defaults to the embedded SmolLM2-135M. `--rtn` writes round-to-nearest checkpoints
with the test-fixture writer (tests/quant_writers.py): an accuracy floor for the format's
conventions, not what GPTQ or AWQ calibration reaches.

`--fp8` adds the base model quantized at load (`quantization="fp8"`: per-channel e4m3
weights) twice: on the CPU's W8A8 reference (activations rounded to e4m3 per token, as the
GPU's GEMMs compute) and weight-only (W8A16, as the GPU's GEMV for 1-16 rows computes).
`--rtn fp8-tensor` writes a vLLM-style FP8 checkpoint with one weight scale per tensor.
A `--checkpoint` name ending in "W8A16" is evaluated weight-only.

`--kv-cache-dtype fp8` adds, for the 16-bit model and each checkpoint, rows with the KV cache
in e4m3 (everything else as in that model's own row; agreement is still against the 16-bit
model with a 16-bit cache). `--kv-scales` picks the K/V scales of those rows, one row each:
`default` (what the engine does without options: the checkpoint's k_scale/v_scale where it
has them, else per KV head calibrated at start-up on the text shipped in the package,
asyncengine/data/kv_calibration.txt), `one` (1.0, vLLM's default, `calculate_kv_scales=False`;
a checkpoint's own scales where it has them), `tensor` (per layer, amax / 448 over a
calibration window) or `head` (the same per KV head). The calibration window of `tensor` and
`head` is the first `--window` tokens of the evaluated text. All calibrate through the
engine's `asyncengine.kv_calibration`. `--save-kv-scales DIR` writes a copy of the 16-bit
model with its per-head calibrated scales (on that window) as vLLM-style
`model.layers.N.self_attn.k_scale` / `v_scale` tensors, which the engine loads
(`kv_cache_dtype="fp8"` then uses them instead of calibrating).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncengine import kv_calibration  # noqa: E402
from asyncengine.kv_calibration import KVScales, set_kv_scales  # noqa: E402
from scripts.bench_common import common_prefix  # noqa: E402

EVAL_TEXT = ROOT / "tests" / "data" / "eval_text.txt"
BLOCK = 16


def eval_tokens(base_dir: Path, text_path: Path = EVAL_TEXT) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    return tok(text_path.read_text(), add_special_tokens=False)["input_ids"]


KV_SCALE_MODES = ("default", "one", "tensor", "head")
FP8 = torch.float8_e4m3fn


def calibrate_kv_scales(model: torch.nn.Module, ids: list[int], per_head: bool) -> KVScales:
    """Per layer, K and V scales from one pass over `ids` (the engine's
    `asyncengine.kv_calibration.calibrate_kv_scales`, a float32 cache on the CPU path): per
    layer, or per KV head with `per_head`. Each scale is float32 [num_kv_heads]."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    # A float32 scratch cache on the CPU; on a GPU the model's dtype, as the engine's own.
    dtype = torch.float32 if param.device.type == "cpu" else param.dtype
    return kv_calibration.calibrate_kv_scales(
        model, ids, dtype=dtype, device=param.device, block_size=BLOCK, per_head=per_head,
    )  # fmt: skip


def engine_calibration_ids(model_dir: Path) -> list[int]:
    """The ids the engine calibrates on at start-up for `model_dir` (its shipped text, as
    the model's tokenizer encodes a prompt)."""
    from transformers import AutoTokenizer

    from models.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return kv_calibration.calibration_token_ids(
        tok, cfg.vocab_size, cfg.max_position_embeddings
    )


def kv_scales_for(
    model: torch.nn.Module, model_dir: Path, mode: str, calibration: list[int]
) -> KVScales | None:
    """The scales of `--kv-scales` mode (None: keep the model's own, 1.0 or the checkpoint's).
    `default` decides as the engine does with `calculate_kv_scales` unset."""
    if mode == "one":
        return None
    if mode == "default":
        if kv_calibration.checkpoint_has_kv_scales(model):
            return None
        return calibrate_kv_scales(model, engine_calibration_ids(model_dir), per_head=True)
    return calibrate_kv_scales(model, calibration, per_head=mode == "head")


def save_kv_scales(base: Path, out: Path, scales: KVScales) -> None:
    """A copy of the model directory `base` plus kv_scales.safetensors holding each layer's
    K and V scales under vLLM's names (one value, or one per KV head)."""
    import shutil

    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.gguf"))
    if (out / "model.safetensors.index.json").exists():
        raise ValueError("sharded checkpoints (an index) are not handled here")
    tensors = {}
    for i, (k_scale, v_scale) in enumerate(scales):
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            same = bool((t == t[0]).all())
            tensors[f"model.layers.{i}.self_attn.{name}"] = t[:1].reshape(()) if same else t
    save_file({k: v.clone().contiguous() for k, v in tensors.items()},
              str(out / "kv_scales.safetensors"))  # fmt: skip


@contextlib.contextmanager
def engine(
    model_dir: Path,
    kv_cache_dtype: str = "auto",
    kv_scales: str = "one",
    calibration: list[int] | None = None,
    quantization: str | None = None,
    weight_only: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
) -> Iterator[Any]:
    """An `LLM` serving `model_dir` with the KV cache and weight format as asked: FP8 KV
    scales by `kv_scales` (KV_SCALE_MODES; `tensor` and `head` calibrated on
    `calibration`), FP8 layers on the W8A16 reference with `weight_only`; float32 on the
    CPU, the checkpoint's dtype elsewhere, unless `dtype`."""
    from asyncengine import LLM
    from models.quantization.fp8 import use_weight_only_reference

    # The engine calibrates `default` itself at start-up; the other modes start it without.
    engine_args = {}
    if kv_cache_dtype != "auto" and kv_scales != "default":
        engine_args["calculate_kv_scales"] = False
    llm = LLM(str(model_dir), dtype=dtype or ("float32" if device == "cpu" else "auto"),
              device=device, num_kv_blocks=None if device == "cuda" else 128,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization,
              **engine_args)  # type: ignore[arg-type]  # fmt: skip
    try:
        model = llm.llm_engine.runner.model
        if weight_only:
            use_weight_only_reference(model)
        if kv_cache_dtype != "auto" and kv_scales in ("tensor", "head"):
            scales = kv_scales_for(model, model_dir, kv_scales, calibration or [])
            if scales is not None:
                set_kv_scales(model, scales)
        yield llm
    finally:
        llm.llm_engine.shutdown()


def windows(tokens: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of `tokens` (each predicts its own tokens 2..); none shorter
    than 2."""
    cut = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    return [w for w in cut if len(w) >= 2]


def engine_perplexity(llm: Any, tokens: list[int], window: int = 256) -> float:
    """exp(mean NLL) over `tokens` in windows, from the engine's prompt logprobs."""
    from asyncengine import SamplingParams

    parts = windows(tokens, window)
    outs = llm.generate(parts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = -sum(
        entry[tok].logprob
        for out in outs
        for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
    )
    return math.exp(nll / sum(len(w) - 1 for w in parts))


def engine_greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def perplexity(
    model_dir: Path,
    tokens: list[int],
    window: int = 256,
    kv_cache_dtype: str = "auto",
    kv_scales: str = "one",
    quantization: str | None = None,
    weight_only: bool = False,
    device: str = "cpu",
) -> float:
    """The perplexity over `tokens` in windows through an engine (`engine`), with
    `kv_cache_dtype="fp8"` through an e4m3 cache with `kv_scales` (KV_SCALE_MODES, `tensor`
    and `head` calibrated on the first window). quantization: the engine's
    `quantization=`; weight_only: FP8 layers on the W8A16 reference."""
    with engine(model_dir, kv_cache_dtype, kv_scales, tokens[:window], quantization,
                weight_only, device) as llm:  # fmt: skip
        return engine_perplexity(llm, tokens, window)


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Share of positions with the same token, and the mean common-prefix length."""
    same = total = prefix = 0
    for a, b in zip(base, other, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
        prefix += common_prefix(a, b)
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
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                    help="also evaluate every model with its KV cache in e4m3")
    ap.add_argument("--kv-scales", default="default",
                    help=f"comma-separated FP8 KV scale modes, of {', '.join(KV_SCALE_MODES)}")
    ap.add_argument("--save-kv-scales", type=Path, metavar="DIR",
                    help="write the 16-bit model with per-head calibrated KV scales to DIR")
    ap.add_argument("--fp8", action="store_true", help="add the base quantized to FP8 at load")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: the torch reference path; cuda: each format's GPU kernels")
    ap.add_argument("--dtype", default=None,
                    help="the engine's dtype (default: float32 on the CPU, else auto)")
    args = ap.parse_args()
    scale_modes = args.kv_scales.split(",")
    if any(m not in KV_SCALE_MODES for m in scale_modes):
        ap.error(f"--kv-scales takes {', '.join(KV_SCALE_MODES)}")
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
    if args.save_kv_scales:
        from models.config import ModelConfig
        from models.loader import load_model

        model = load_model(args.base, ModelConfig.from_dir(args.base), dtype=torch.float32,
                           device=torch.device("cpu"))  # fmt: skip
        scales = calibrate_kv_scales(model, tokens[: args.window], per_head=True)
        save_kv_scales(args.base, args.save_kv_scales, scales)
        models[f"16-bit, scales saved in {args.save_kv_scales.name}"] = (
            args.save_kv_scales, None, False)
    rows = []
    base_ppl, base_out = None, None
    runs = []
    for name, (path, quant, weight_only) in models.items():
        runs.append((name, path, "auto", "one", quant, weight_only))
        if args.kv_cache_dtype != "auto":
            for mode in scale_modes:
                runs.append((f"{name} + fp8 KV (scales: {mode})", path, "fp8", mode, quant,
                             weight_only))  # fmt: skip
    calibration = tokens[: args.window]
    for name, path, kv, mode, quant, weight_only in runs:
        with engine(path, kv, mode, calibration, quant, weight_only, args.device,
                    args.dtype) as llm:  # fmt: skip
            ppl = engine_perplexity(llm, tokens, args.window)
            out = engine_greedy(llm, prompts, args.max_tokens)
        base_ppl, base_out = base_ppl or ppl, base_out or out
        row = {"model": name, "perplexity": round(ppl, 3),
               "ppl_increase": round(ppl / base_ppl - 1, 4),
               **{k: round(v, 3) for k, v in agreement(base_out, out).items()}}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{len(tokens)} tokens, windows of {args.window}; greedy: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens; perplexity from the engine's prompt logprobs on "
          f"{args.device}\n")  # fmt: skip
    print("| format | perplexity | increase | token agreement | mean common prefix |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['perplexity']:.3f} | {100 * r['ppl_increase']:+.2f} % | "
              f"{100 * r['token_agreement']:.1f} % | {r['mean_common_prefix']:.1f} |")


if __name__ == "__main__":
    main()
