"""The attention of open models as differentiable functions and PyTorch operators (lesson 15).

Introduced in notebooks/15_attention_variants.ipynb. ``flash_attn_v2`` sends a call with a
variant (``window_size``, ``softcap``, ``alibi_slopes``, ``sinks``) here; ``flash_attn_varlen``
takes packed sequences. Both follow FlashAttention's arguments and semantics
(github.com/Dao-AILab/flash-attention, ``flash_attn_func`` and ``flash_attn_varlen_func``), with
sinks as GPT-OSS's per-head logit. The kernels: ``kernels/flash_variants.py`` (the portable
forward, and every packed call), ``kernels/flash_variants_hopper.py`` (the TMA forward) and
``kernels/flash_variants_bwd.py``. The checked variants travel as one ``validate.Variant``.

Each direction is an operator (``course_lib.ops.library``): ``course::flash_attn_variants_fwd``
/ ``_bwd`` and ``course::flash_attn_varlen_fwd`` / ``_bwd``. A forward's autograd saves q, k, v,
O and the lse, and returns the gradients of q, k, v and the sinks (the ALiBi slopes are
constants, as in FlashAttention). The checks read no value on the GPU but with ``validate=True``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from course_lib._device import DEVICE
from course_lib.kernels.attention_common import MAX_GRID_Y, allocate_outputs
from course_lib.kernels.flash_variants import forward_variants, forward_variants_varlen
from course_lib.kernels.flash_variants_bwd import backward_variants, backward_variants_varlen
from course_lib.kernels.flash_variants_hopper import MEASURED_HEAD_DIMS, forward_variants_hopper
from course_lib.ops.impl import best_impl
from course_lib.ops.library import operator
from course_lib.validate import (
    Variant,
    check_attention_inputs,
    check_sm_scale,
    check_tensor,
    check_variants,
    check_varlen,
)

NO_WINDOW = (-1, -1)


def check_grid(q) -> None:
    """ValueError if q's batch x heads exceed the grid axis that carries them."""
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"q's batch x heads = {q.shape[0] * q.shape[1]} exceeds {MAX_GRID_Y}, "
                         "the CUDA grid's limit on the axis that carries them; split the batch")


def check_call(q, k, v, causal, sm_scale, window_size, softcap, alibi_slopes, sinks):
    """The checks of a dense call with variants: (sm_scale, ``Variant``), normalised."""
    sm_scale = check_sm_scale(sm_scale, check_attention_inputs(q, k, v)[-1])
    variant = check_variants(q, causal, window_size, softcap, alibi_slopes, sinks)
    check_grid(q)
    return sm_scale, variant


_FORWARDS = {"portable": forward_variants, "hopper": forward_variants_hopper}


def _forward(q, k, v, sm_scale, variant, impl, store_lse=True):
    """The launcher ``impl`` names. "auto": ``best_impl``'s pick for the head dims whose TMA
    config was measured with the variants (``MEASURED_HEAD_DIMS``), else the portable one."""
    if impl == "auto":
        impl = best_impl(q, k, v) if q.shape[-1] in MEASURED_HEAD_DIMS else "portable"
    return _FORWARDS[impl](q, k, v, sm_scale, variant, store_lse=store_lse)


def flash_attn_variants(q, k, v, sm_scale, variant, return_lse=False, impl=None):
    """The variants' forward (and autograd) on arguments checked as ``flash_attn_v2`` checks
    them (``check_call``, ``check_impl``)."""
    impl = impl or "auto"
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, variant.sinks))
    if needs_grad or torch.compiler.is_compiling() or return_lse:
        o, lse = _flash_attn_variants_fwd(q, k, v, sm_scale, *_op_args(variant), impl)
    else:  # eager, no autograd: the launcher directly, without the dispatcher, and no lse
        o, lse = _forward(q, k, v, sm_scale, variant, impl, store_lse=False)
    return (o, lse) if return_lse else o


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate):
    """Packed q (total_q, H, D), k and v (total_k, H_kv, D) and their offsets; returns D."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3)
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] * q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must hold some rows")
    # the dense checks on (1, H, total, D) views: dtypes, devices, GQA, head dim
    check_attention_inputs(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                           v.transpose(0, 1)[None])
    read = DEVICE == "cpu" if validate is None else bool(validate)
    check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 read_values=read and not torch.compiler.is_compiling())
    return q.shape[-1]


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      causal=False, sm_scale=None, *, window_size=NO_WINDOW, softcap=0.0,
                      alibi_slopes=None, sinks=None, return_lse=False, validate=None):
    """Attention over packed sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func``), forward and backward.

    q (total_q, H, D); k, v (total_k, H_kv, D), H a multiple of H_kv; ``cu_seqlens_q`` and
    ``cu_seqlens_k`` int32 (B + 1,): sequence b is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``
    of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k and v, aligned bottom-right on its
    own; ``max_seqlen_*`` the longest (the grid covers it). The variants as in ``flash_attn_v2``.
    Returns O (total_q, H, D) in q's dtype, and with ``return_lse`` the lse (H, total_q) fp32.
    ``validate`` (None: on the CPU only) checks the offsets' values (a read-back on a GPU).
    """
    D = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
    sm_scale = check_sm_scale(sm_scale, D)
    batch = q.transpose(0, 1)[None].expand(cu_seqlens_q.shape[0] - 1, -1, -1, -1)  # (B, H, ..)
    variant = check_variants(batch, causal, window_size, softcap, alibi_slopes, sinks)
    o, lse = _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                    int(max_seqlen_k), sm_scale, *_op_args(variant))
    return (o, lse) if return_lse else o


# The operators (course_lib.ops.library) take a variant as five arguments (window_left,
# window_right, softcap, alibi_slopes, sinks); a backward returns an empty dsinks without sinks.
def _op_args(variant: Variant) -> tuple:
    return (*variant.window, variant.softcap, variant.alibi_slopes, variant.sinks)


def _dsinks(dsinks, q):
    return dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32)


def _grads_fake(do, q, k, v, *args):
    sinks = args[-1]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _dsinks(None if sinks is None else sinks.new_empty(sinks.shape), q))


def _setup_variants(ctx, inputs, output):
    q, k, v, *scalars, alibi_slopes, sinks, _impl = inputs
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, sinks)
    ctx.mark_non_differentiable(output[1])
    ctx.scalars = scalars  # sm_scale, window_left, window_right, softcap


def _backward_variants(ctx, do, _dlse):
    q, k, v, o, lse, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attn_variants_bwd(do, q, k, v, o, lse, *ctx.scalars,
                                                  alibi_slopes, sinks)
    # q, k, v; sm_scale, window_left, window_right, softcap, alibi_slopes; sinks; impl
    return dq, dk, dv, *(None,) * 5, None if sinks is None else dsinks, None


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *scalars, alibi_slopes, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.mark_non_differentiable(output[1])
    ctx.scalars = scalars  # the two max_seqlen, sm_scale, the window, softcap


def _backward_varlen(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attn_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                                *ctx.scalars, alibi_slopes, sinks)
    # q, k, v; the two offsets, the two lengths, sm_scale, the window, softcap, alibi_slopes; sinks
    return dq, dk, dv, *(None,) * 9, None if sinks is None else dsinks


@operator(lambda q, *_: allocate_outputs(q), setup_context=_setup_variants,
          backward=_backward_variants)
def _flash_attn_variants_fwd(q: Tensor, k: Tensor, v: Tensor, sm_scale: float, window_left: int,
                             window_right: int, softcap: float, alibi_slopes: Tensor | None,
                             sinks: Tensor | None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    variant = Variant((window_left, window_right), softcap, alibi_slopes, sinks)
    return _forward(q, k, v, sm_scale, variant, impl)


@operator(_grads_fake)
def _flash_attn_variants_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                             sm_scale: float, window_left: int, window_right: int,
                             softcap: float, alibi_slopes: Tensor | None,
                             sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    variant = Variant((window_left, window_right), softcap, alibi_slopes, sinks)
    dq, dk, dv, dsinks = backward_variants(do, q, k, v, o, lse, sm_scale, variant)
    return dq, dk, dv, _dsinks(dsinks, q)


@operator(lambda q, *_: (q.new_empty(q.shape),
                         q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)),
          setup_context=_setup_varlen, backward=_backward_varlen)
def _flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           sm_scale: float, window_left: int, window_right: int, softcap: float,
                           alibi_slopes: Tensor | None,
                           sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    variant = Variant((window_left, window_right), softcap, alibi_slopes, sinks)
    return forward_variants_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, sm_scale, variant)


@operator(_grads_fake)
def _flash_attn_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                           cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                           max_seqlen_k: int, sm_scale: float, window_left: int,
                           window_right: int, softcap: float, alibi_slopes: Tensor | None,
                           sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    variant = Variant((window_left, window_right), softcap, alibi_slopes, sinks)
    dq, dk, dv, dsinks = backward_variants_varlen(do, q, k, v, o, lse, cu_seqlens_q,
                                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  sm_scale, variant)
    return dq, dk, dv, _dsinks(dsinks, q)
