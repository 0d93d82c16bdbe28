"""FlashAttention-2 as one differentiable function: ``flash_attn_v2`` and its autograd Function.

Introduced in notebooks/08_triton_flash_v2.ipynb (the backward in notebooks/10_backward.ipynb).
The kernels live one version per file in ``course_lib.kernels``: the portable forward
(``flash_v2``), the Hopper forward (``flash_v2_hopper``) and the backward (``flash_bwd``). This
module validates the inputs, picks the forward for the GPU (``best_impl``), and ties the forward
and the backward together in ``FlashAttnV2Function``: it saves q, k, v, O and the lse (never P).
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE
from course_lib.kernels.attention_common import MAX_GRID_Y
from course_lib.kernels.flash_bwd import flash_attn_v2_backward
from course_lib.kernels.flash_v2 import forward_portable
from course_lib.kernels.flash_v2_hopper import forward_hopper, tma_compatible
from course_lib.validate import check_attention_inputs, check_sm_scale


def _available_impls() -> tuple[str, ...]:
    if DEVICE == "cpu":
        return ("portable", "hopper")  # the interpreter runs both kernels
    if torch.cuda.get_device_capability()[0] >= 9:
        return ("portable", "hopper")
    return ("portable",)


IMPLS = _available_impls()


def best_impl(q: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> str:
    """The implementation ``impl=None`` picks: the Hopper kernel on sm_90 for head dims of 64
    and more when every input suits TMA (``tma_compatible``), else the portable one. The
    measurements behind it (the Hopper kernel faster at every shape of the sweep from D 64 on;
    smaller head dims not measured) are in course_lib/data/attention_fwd.json."""
    if DEVICE == "cuda" and "hopper" in IMPLS and q.shape[-1] >= 64:
        if all(tma_compatible(t) for t in (q, k, v) if t is not None):
            return "hopper"
    return "portable"


def _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl=None, out=None):
    """Forward on validated inputs: returns (o in q's dtype, lse fp32 natural log).

    ``out`` = (o, lse) preallocated (contiguous) lets tests poison the outputs with NaN first.
    """
    impl = impl or best_impl(q, k, v)
    if impl == "portable":
        return forward_portable(q, k, v, causal, sm_scale, out)
    if impl == "hopper":
        return forward_hopper(q, k, v, causal, sm_scale, out)
    raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")


def flash_attn_v2(q, k, v, causal=False, sm_scale=None, return_lse=False, impl=None):
    """FlashAttention-2: softmax(sm_scale·QKᵀ [+ causal mask])·V, fused in one Triton kernel.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D) with H a multiple of H_kv. ``causal`` is
    bottom-right aligned. Returns O (B, H, N_q, D) in q's dtype, and with ``return_lse`` also the
    natural-log log-sum-exp (B, H, N_q) in fp32. ``impl`` picks a kernel from ``IMPLS`` (None:
    the fastest for this GPU). Differentiable when an input requires grad.
    """
    D = check_attention_inputs(q, k, v)[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"q's batch x heads = {q.shape[0] * q.shape[1]} exceeds {MAX_GRID_Y}, "
                         "the CUDA grid's limit on the axis that carries them; split the batch")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return FlashAttnV2Function.apply(q, k, v, causal, sm_scale, return_lse, impl)
    o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl)
    return (o, lse) if return_lse else o


class FlashAttnV2Function(torch.autograd.Function):
    """``flash_attn_v2`` with a backward: saves q, k, v, O and the lse (never P).

    Called by ``flash_attn_v2`` on validated inputs when a gradient
    is needed. Returns O, or (O, lse) with the lse marked non-differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, return_lse=False, impl=None):
        sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl=impl)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = bool(causal)
        ctx.sm_scale = sm_scale
        if return_lse:
            ctx.mark_non_differentiable(lse)
            return o, lse
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, *_unused_dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_v2_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None, None, None
