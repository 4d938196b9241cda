"""Engine arguments (vLLM's names) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from models.quantization.config import QUANT_METHODS

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
# vLLM's values: "auto" stores K/V in the model dtype; "fp8" means e4m3.
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineArgs:
    """Everything that configures an engine. `model=None` selects the embedded default model."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: Dtype = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    swap_space: float = 4.0
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    enable_prefix_caching: bool = True
    # A ceiling: admission keeps room for the running requests' growth, so the KV pool
    # decides how many run below it (see asyncengine.admission).
    max_num_seqs: int = 256
    # How much room admission keeps for the running requests' expected growth (SGLang's
    # name): 1.0 the adaptive estimate, 0 none (admit whatever fits now, as vLLM), above 1
    # more.
    schedule_conservativeness: float = 1.0
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    # Schedule and launch step N+1 before step N's sampled ids reach the host, so the device
    # never waits for host work. None: on for CUDA, off on the CPU (where the step computes
    # while it launches, so there is nothing to overlap). Tensor-parallel workers follow rank
    # 0's overlap. Steps run one at a time while any request needs its exact history
    # (penalties, min_tokens).
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    quantization: str | None = None
    # "fp8" / "fp8_e4m3": the KV cache stores e4m3 with K and V scales per layer or per KV
    # head (the checkpoint's k_scale / v_scale, else calibrated at start-up), halving its bytes
    # per token.
    kv_cache_dtype: KVCacheDtype = "auto"
    # FP8 KV scales from one pass over a calibration text at start-up, per KV head (see
    # asyncengine.kv_calibration). None: when the checkpoint carries no KV scales; True: also
    # replacing the checkpoint's; False: never (scales 1.0 without checkpoint scales, as vLLM).
    calculate_kv_scales: bool | None = None
    skip_tokenizer_init: bool = False
    # CPU only: cap on the KV pool when memory is not otherwise bounded.
    cpu_kv_cache_gib: float = 2.0
    # vLLM's spelling: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
    # a, "prompt_lookup_max": b} or {"model": draft_dir, "num_speculative_tokens": k}
    # (see asyncengine.spec_decode.config).
    speculative_config: dict | None = None
    # Structured outputs: a request whose grammar takes longer than this to compile is
    # refused; jump-forward verifies the tokens a grammar forces as drafts, several in one
    # step, keeping those the model itself would have produced (asyncengine.spec_decode.forced).
    structured_outputs_compile_timeout: float = 30.0
    structured_outputs_jump_forward: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        if self.dtype not in ("auto", *_DTYPES):
            fail("dtype", "must be one of auto, float32, float16, bfloat16")
        if self.device not in ("auto", "cpu", "cuda"):
            fail("device", "must be one of auto, cpu, cuda")
        if not self.structured_outputs_compile_timeout > 0:
            fail("structured_outputs_compile_timeout", "must be > 0")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            fail("block_size", "must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks", "must be >= 1")
        if self.swap_space < 0:
            fail("swap_space", "must be >= 0")
        if self.preemption_mode not in ("recompute", "swap"):
            fail("preemption_mode", "must be recompute or swap")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be >= 1")
        if not self.schedule_conservativeness >= 0:
            fail("schedule_conservativeness", "must be >= 0")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len", "must be >= 1")
        if self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "must be >= 1")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            fail("load_format", "must be one of auto, safetensors, gguf, dummy")
        if self.quantization not in (None, "none", *QUANT_METHODS):
            fail("quantization", f"must be one of none, {', '.join(QUANT_METHODS)}")
        if self.kv_cache_dtype not in ("auto", *_KV_CACHE_DTYPES):
            fail("kv_cache_dtype", "must be one of auto, fp8, fp8_e4m3")
        if self.calculate_kv_scales not in (None, True, False):
            fail("calculate_kv_scales", "must be true, false or unset")
        if self.speculative_config is not None:
            self._validate_speculative_config()
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            fail(
                "calculate_kv_scales",
                "needs kv_cache_dtype fp8 or fp8_e4m3 (a 16-bit KV cache has no scales)",
            )

    def _validate_speculative_config(self) -> None:
        from asyncengine.spec_decode.config import SpeculativeConfig

        # Its fields, at start; a draft model's own checks run when it is loaded. Under
        # tensor parallelism a draft model runs whole on rank 0 (vLLM's draft tensor-parallel
        # size 1): it is small, and its steps need no collective.
        SpeculativeConfig.from_dict(self.speculative_config)  # type: ignore[arg-type]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but no CUDA device is available")
        return torch.device(self.device)

    def resolve_dtype(self, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        if config_dtype in (torch.float16, torch.bfloat16):
            return config_dtype
        return torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV cache's element type. FP8 needs a GPU with e4m3 support (compute capability
        8.9 or newer); anywhere else on CUDA it is refused, never silently replaced."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9):
                name = torch.cuda.get_device_name(device)
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU with FP8 (e4m3) "
                    f"support, compute capability 8.9 or newer (Ada, Hopper); {name} has "
                    f"{cap[0]}.{cap[1]}. Use kv_cache_dtype='auto'."
                )
        return _KV_CACHE_DTYPES[self.kv_cache_dtype]
