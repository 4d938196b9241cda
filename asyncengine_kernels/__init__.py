"""Triton kernels of asyncengine, each beside a plain-torch reference with the same signature.

The public ops dispatch on the device: Triton for CUDA tensors, the reference (the engine's CPU
path and the test oracle) otherwise. Importing this package never needs a GPU or Triton.
"""

from asyncengine_kernels._triton_utils import triton_available
from asyncengine_kernels.activation import silu_and_mul
from asyncengine_kernels.kv_cache_write import write_kv_cache
from asyncengine_kernels.paged_attention import paged_attention
from asyncengine_kernels.rms_norm import fused_add_rms_norm, rms_norm
from asyncengine_kernels.rotary import apply_rotary_emb
from asyncengine_kernels.rotary_kv_cache import rotary_and_write_kv
from asyncengine_kernels.rotary_paged_attention import paged_decode_attention_with_rotary
from asyncengine_kernels.sampling import apply_top_k_top_p_min_p_ref, sample_from_logits

__all__ = [
    "apply_rotary_emb",
    "apply_top_k_top_p_min_p_ref",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_decode_attention_with_rotary",
    "rms_norm",
    "rotary_and_write_kv",
    "sample_from_logits",
    "silu_and_mul",
    "triton_available",
    "write_kv_cache",
]
