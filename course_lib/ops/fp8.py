"""FP8 attention's forward as a function to call (notebooks/09b_fp8.ipynb).

``flash_attn_fp8(q, k, v)`` quantizes q, k and v to e4m3 with block scales (after a random
rotation of q and k, FlashAttention-3's incoherent processing) and runs the FP8 kernel
(``course_lib.kernels.flash_fp8``). A forward for inference: O carries no gradient.
"""
from __future__ import annotations

from course_lib.kernels.flash_fp8 import FP8_CONFIGS, forward_fp8, prepare_fp8
from course_lib.ops.impl import IMPLS
from course_lib.validate import check_attention_inputs, check_sm_scale


def flash_attn_fp8(q, k, v, causal=False, sm_scale=None, return_lse=False, *, rotate=True,
                   seed=0):
    """softmax(sm_scale·QKᵀ [+ causal mask])·V with Q, K, V and P in e4m3.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D), H a multiple of H_kv, D 64 or 128; ``causal``
    bottom-right aligned. Returns O (B, H, N_q, D) in q's dtype, and with ``return_lse`` the
    natural-log log-sum-exp (B, H, N_q) fp32. ``rotate``: q and k times
    ``course_lib.fp8.random_rotation(D, seed)`` before their quantization. Its error is that of
    ``course_lib.fp8.attention_lowp`` with the kernel's blocks (``kernels.flash_fp8.fp8_blocks``).
    Runs on sm_90 (Hopper's FP8 tensor cores and TMA) and in the interpreter."""
    D = check_attention_inputs(q, k, v, head_dims=tuple(FP8_CONFIGS))[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if "hopper" not in IMPLS:
        raise ValueError("flash_attn_fp8 runs on an sm_90 GPU (or the interpreter): it needs "
                         "Hopper's FP8 tensor cores and TMA")
    o, lse = forward_fp8(prepare_fp8(q, k, v, rotate, seed), causal, sm_scale, q.dtype,
                         store_lse=return_lse)
    return (o, lse) if return_lse else o


__all__ = ["flash_attn_fp8"]
