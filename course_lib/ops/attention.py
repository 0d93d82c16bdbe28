"""FlashAttention-2 as one differentiable function, and as PyTorch operators.

Introduced in notebooks/08_triton_flash_v2.ipynb (the backward in notebooks/10_backward.ipynb).
This module checks the inputs, picks the forward kernel (``best_impl``) and registers the
operators ``course::flash_attn_fwd`` and ``course::flash_attn_bwd`` (``course_lib.ops.library``),
which ``torch.compile(fullgraph=True)`` traces through; the forward's autograd saves q, k, v, O
and the lse (never P). An eager call with no gradient skips the dispatcher.

The fast path (a GPU): an eager call with no gradient and no lse keeps its launch, bound to all
but the addresses (``course_lib._launch.bind``), in ``_FAST``, keyed by what the checks and the
kernel read of the call (``call_key``: shapes, strides, dtypes, devices, the scale; ``causal``,
``impl``, the window and softcap; not a call with ALiBi slopes or sinks, tensors whose values
may change). A later call with that key, 16-byte aligned inputs and no profiler hooks is an
allocation of O and one call into Triton's C launcher.

The variants of open models (notebooks/15_attention_variants.ipynb): a call of ``flash_attn_v2``
with ``window_size``, ``softcap``, ``alibi_slopes`` or ``sinks``, and ``flash_attn_varlen``
(packed sequences), follow FlashAttention's arguments and semantics
(github.com/Dao-AILab/flash-attention, ``flash_attn_func`` and ``flash_attn_varlen_func``), with
sinks as GPT-OSS's per-head logit. They are checked into one ``masks.Variant`` and run the
variants' kernels (``kernels/flash_variants.py``, ``flash_variants_hopper.py``,
``flash_variants_bwd.py``) through the operators ``course::flash_attn_variants_fwd`` / ``_bwd``
and ``course::flash_attn_varlen_fwd`` / ``_bwd``, whose autograd returns the gradients of q, k,
v and the sinks (the ALiBi slopes are constants, as in FlashAttention). The checks read no value
on the GPU but with ``validate=True``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from course_lib import _launch
from course_lib._device import DEVICE
from course_lib._launch import hooks_installed
from course_lib.kernels.attention_common import (
    MAX_GRID_Y,
    allocate_outputs,
    call_key,
    empty_like_is_output,
    empty_output,
)
from course_lib.kernels.flash_bwd import flash_attn_v2_backward
from course_lib.kernels.flash_v2 import forward_portable
from course_lib.kernels.flash_v2_hopper import forward_hopper
from course_lib.kernels.flash_variants import forward_variants, forward_variants_varlen
from course_lib.kernels.flash_variants_bwd import backward_variants, backward_variants_varlen
from course_lib.kernels.flash_variants_hopper import MEASURED_HEAD_DIMS, forward_variants_hopper
from course_lib.masks import NO_WINDOW, Variant, check_variants
from course_lib.ops.impl import IMPLS, best_impl, check_impl  # noqa: F401 (IMPLS re-exported)
from course_lib.ops.library import operator
from course_lib.validate import (
    GPU_DTYPES,
    KV_QUANT_DTYPES,
    check_attention_inputs,
    check_block_table,
    check_int_tensor,
    check_kv_scale,
    check_sm_scale,
    check_tensor,
    check_varlen,
)

_FORWARDS = {"portable": forward_portable, "hopper": forward_hopper}  # impl -> its launcher


def _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl=None, out=None, store_lse=True):
    """Forward on validated inputs: (o in q's layout and dtype, lse fp32 natural log, None
    without ``store_lse``). ``out`` = (o, lse) preallocated lets tests poison them first."""
    check_impl(impl)
    return _FORWARDS[impl or best_impl(q, k, v)](q, k, v, causal, sm_scale, out=out,
                                                 store_lse=store_lse)


def flash_attn_v2(q, k, v, causal=False, sm_scale=None, return_lse=False, impl=None, *,
                  window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """FlashAttention-2: softmax(sm_scale·QKᵀ [+ causal mask])·V, fused in one Triton kernel.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D) with H a multiple of H_kv. ``causal`` is
    bottom-right aligned. Returns O (B, H, N_q, D) in q's dtype and layout (for a q that is a
    (B, N_q, H, D) tensor seen through ``transpose(1, 2)``, ``O.transpose(1, 2)`` is
    contiguous), and with ``return_lse`` the natural-log log-sum-exp (B, H, N_q) in fp32 (with
    neither it nor a gradient, the kernel stores none). ``impl`` picks a kernel from ``IMPLS``
    (None: the fastest for this GPU). Differentiable, and traceable by ``torch.compile``
    (``course::flash_attn_fwd``).

    The variants of open models (lesson 15, below), FlashAttention's
    keywords: ``window_size=(left, right)``, query i at key position p = i + N_k − N_q sees keys
    p − left <= j <= p + right (−1: unbounded; ``causal`` is right = 0); ``softcap`` c > 0,
    s = c·tanh(s / c) on the scaled scores; ``alibi_slopes`` (H,) or (B, H) fp32 adds
    −slope·|p − j|; ``sinks`` (H,) fp32, a learnable per-head logit in the softmax's denominator
    with no value (its gradient too). A call with any of them runs the variants' kernels (the
    portable one or the TMA one, as ``best_impl`` or ``impl`` says); a row that sees no key gets
    O = 0 and lse = −inf (the sink).
    """
    key = None
    if (_REMEMBER and not return_lse and alibi_slopes is None and sinks is None
            and not torch.compiler.is_compiling()):
        try:  # (the window and softcap with their types: True equals 1 but is no number)
            window = None if window_size is NO_WINDOW else tuple((type(w), w) for w in window_size)
            key = (call_key(q, k, v, sm_scale), type(causal), causal, impl, window, type(softcap),
                   softcap)
            fast = _FAST.get(key)
        except (AttributeError, TypeError):  # not a tensor, unhashable: the checks name it
            key = fast = None
        if (fast is not None and _launch.FAST
                and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                      or v.requires_grad))
                and not hooks_installed()):
            return fast(q, k, v)
    if window_size is not NO_WINDOW or softcap or alibi_slopes is not None or sinks is not None:
        sm_scale, variant = check_call(q, k, v, causal, sm_scale, window_size, softcap,
                                       alibi_slopes, sinks)
        if not (variant.dense and variant.window in (NO_WINDOW, (-1, 0))):
            check_impl(impl)
            return flash_attn_variants(q, k, v, sm_scale, variant, return_lse, impl, key)
        causal = variant.window == (-1, 0)  # plain (causal) attention as a window: dense path
    sm_scale = check_sm_scale(sm_scale, check_attention_inputs(q, k, v)[-1])
    check_impl(impl)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_grid(q)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad or torch.compiler.is_compiling():
        o, lse = _flash_attn_fwd(q, k, v, causal, sm_scale, impl or "auto")
    elif key is None:  # eager, no autograd: the kernel directly (lse only when asked for)
        o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl, store_lse=return_lse)
    else:  # ... and the launch kept for the next call with this key
        o, lse, again = _FORWARDS[impl or best_impl(q, k, v)](q, k, v, causal, sm_scale,
                                                             store_lse=False, bind=True)
        _remember(key, again, o, q)
    return (o, lse) if return_lse else o


def _remember(key, again, o, q) -> None:
    """Keep a call's bound launch ``again`` (None: nothing to keep) under its key."""
    if again is not None:
        if len(_FAST) >= 256:  # shapes that change at every call must not grow it
            _FAST.clear()
        _FAST[key] = _FastCall(again, o, q)


class _FastCall:
    """A kept call: ``self(q, k, v)`` allocates O laid out as that call's O and runs the bound
    launch at the new addresses (no lse). Where ``torch.empty_like(q)`` gives that O
    (``empty_like_is_output``) it is used: a µs or two less host time per call."""

    __slots__ = ("again", "shape", "transposed", "dtype", "device", "like")

    def __init__(self, again, o, q):
        self.again = again
        self.transposed = not o.is_contiguous()  # the (B, N_q, H, D) layout seen transposed
        self.shape = tuple(o.transpose(1, 2).shape if self.transposed else o.shape)
        self.dtype, self.device = o.dtype, o.device
        self.like = empty_like_is_output(q)  # (the key holds q's strides)

    def __call__(self, q, k, v):
        if self.like:
            o = torch.empty_like(q)
        else:
            o = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            o = o.transpose(1, 2) if self.transposed else o
        p = o.data_ptr()
        self.again(q.data_ptr(), k.data_ptr(), v.data_ptr(), p, p)
        return o


# The fast path's cache: call key -> _FastCall. On a GPU only: the interpreter binds nothing.
_REMEMBER = DEVICE == "cuda"
_FAST: dict = {}


# The operators (course_lib.ops.library); the forward with its autograd formula.
def _setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale, _impl = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.sm_scale = causal, sm_scale
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None, None


def _flash_attn_fwd_fake(q, *_):  # O laid out as the kernels lay it out: as q is
    return empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@operator(_flash_attn_fwd_fake, setup_context=_setup_context, backward=_backward)
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float,
                    impl: str) -> tuple[Tensor, Tensor]:
    """(O, lse) of validated inputs; ``impl`` "auto" lets ``best_impl`` pick. The kernels take
    any strides with a unit last one (the launchers copy other inputs): a transposed view is
    not copied."""
    return _flash_attn_v2_forward(q, k, v, causal, sm_scale, None if impl == "auto" else impl)


@operator(lambda do, q, k, v, *_: (q.new_empty(q.shape), k.new_empty(k.shape),
                                   v.new_empty(v.shape)))
def _flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                    causal: bool, sm_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``O = flash_attn_v2(q, k, v)`` for the gradient ``do`` of O."""
    return flash_attn_v2_backward(do, q, k, v, o, lse, causal, sm_scale)


# ---------------------------------------------------------------------------------------------
# the variants of open models and packed sequences (lesson 15)
# ---------------------------------------------------------------------------------------------

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


_VARIANT_FORWARDS = {"portable": forward_variants, "hopper": forward_variants_hopper}


def _variants_forward(q, k, v, sm_scale, variant, impl, **options):
    """The launcher ``impl`` names. "auto": ``best_impl``'s pick for the head dims whose TMA
    config was measured with the variants (``MEASURED_HEAD_DIMS``), else the portable one."""
    if impl == "auto":
        impl = best_impl(q, k, v) if q.shape[-1] in MEASURED_HEAD_DIMS else "portable"
    return _VARIANT_FORWARDS[impl](q, k, v, sm_scale, variant, **options)


def flash_attn_variants(q, k, v, sm_scale, variant, return_lse=False, impl=None, key=None):
    """The variants' forward (and autograd) on arguments checked as ``flash_attn_v2`` checks
    them (``check_call``, ``check_impl``); ``key``: the fast path's, to keep the launch under."""
    impl = impl or "auto"
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, variant.sinks))
    if needs_grad or torch.compiler.is_compiling() or return_lse:
        o, lse = _flash_attn_variants_fwd(q, k, v, sm_scale, *_op_args(variant), impl)
    elif key is None:  # eager, no autograd: the launcher directly, without the dispatcher
        o, lse = _variants_forward(q, k, v, sm_scale, variant, impl, store_lse=False)
    else:  # ... and the launch kept for the next call with this key
        o, lse, again = _variants_forward(q, k, v, sm_scale, variant, impl, store_lse=False,
                                          bind=True)
        _remember(key, again, o, q)
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
                      alibi_slopes=None, sinks=None, return_lse=False, validate=None,
                      block_table=None, k_scale=None, v_scale=None):
    """Attention over packed sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func``), forward and backward.

    q (total_q, H, D); k, v (total_k, H_kv, D), H a multiple of H_kv; ``cu_seqlens_q`` and
    ``cu_seqlens_k`` int32 (B + 1,): sequence b is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``
    of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k and v, aligned bottom-right on its
    own; ``max_seqlen_*`` the longest (the grid covers it). The variants as in ``flash_attn_v2``.
    Returns O (total_q, H, D) in q's dtype, and with ``return_lse`` the lse (H, total_q) fp32.
    ``validate`` (None: on the CPU only) checks the offsets' values (a read-back on a GPU).

    ``block_table`` (B, max_blocks) int32, as FlashAttention's: k and v are a paged cache
    (num_blocks, page_size, H_kv, D) (lesson 13's layout), and sequence b's keys are its first
    ``cu_seqlens_k[b + 1] − cu_seqlens_k[b]`` keys, key n in page ``block_table[b, n //
    page_size]`` at slot ``n % page_size`` (the offsets give lengths only). A serving engine's
    mixed step runs this way (lesson 16): prefill chunks and decode tokens in one call, each
    against its sequence's whole cache. Forward only: no gradient flows through a paged cache.
    ``validate`` then checks the key counts against the table and every block id in use
    (``paged_decode``'s rule); values nothing checked are clamped by the kernel into the table
    and the pool: a wrong answer, never a read outside them. The pages may be 8-bit (int8 or
    FP8 e4m3, ``course_lib.kvquant``) with ``k_scale`` and ``v_scale``, fp32 (num_blocks,
    page_size, H_kv), one scale per token and head, applied as the kernel reads them.
    """
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, sm_scale, window_size, softcap, alibi_slopes, sinks,
                             return_lse, validate, block_table, k_scale, v_scale)
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale and v_scale are for 8-bit pages: pass block_table too")
    D = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
    sm_scale = check_sm_scale(sm_scale, D)
    batch = q.transpose(0, 1)[None].expand(cu_seqlens_q.shape[0] - 1, -1, -1, -1)  # (B, H, ..)
    variant = check_variants(batch, causal, window_size, softcap, alibi_slopes, sinks)
    o, lse = _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                    int(max_seqlen_k), sm_scale, *_op_args(variant))
    return (o, lse) if return_lse else o


def _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  sm_scale, window_size, softcap, alibi_slopes, sinks, return_lse, validate,
                  block_table, k_scale=None, v_scale=None):
    """``flash_attn_varlen`` on a paged k and v: the checks, then the operator."""
    quantized = isinstance(k, torch.Tensor) and k.dtype in KV_QUANT_DTYPES
    check_tensor("q", q, 3)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4, KV_QUANT_DTYPES if quantized else GPU_DTYPES)
    for name, scale, cache in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        check_kv_scale(name, scale, name[0], cache)
        if scale is not None and scale.stride() != (scale.shape[1] * scale.shape[2],
                                                     scale.shape[2], 1):
            raise ValueError(f"{name} must be contiguous, got strides {scale.stride()}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_blocks, page_size = k.shape[0], k.shape[1]
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(0) != page_size * t.stride(1):
            raise ValueError(f"{name} must be pages (num_blocks, page_size, H_kv, D) with each "
                             f"page contiguous in its first two dims, got strides {t.stride()}")
    if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        raise NotImplementedError("block_table: attention over a paged cache has no backward")
    check_attention_inputs(q.transpose(0, 1)[None], k[:1, :1].flatten(0, 1).transpose(0, 1)[None],
                           v[:1, :1].flatten(0, 1).transpose(0, 1)[None], quantized_kv=quantized)
    B = check_varlen(q, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_q)
    check_int_tensor("block_table", block_table, B, q.device, ndim=2,
                     shape=f"({B}, max_blocks) (one row per sequence)")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise TypeError(f"max_seqlen_k must be a non-negative int, got {max_seqlen_k!r}")
    if (DEVICE == "cpu" if validate is None else bool(validate)) and \
            not torch.compiler.is_compiling():
        check_varlen(q, q, cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_q, True)
        lens_k = cu_seqlens_k.diff()
        lo, hi, capacity = int(lens_k.min()), int(lens_k.max()), block_table.shape[1] * page_size
        if lo < 0 or hi > capacity:
            raise ValueError(f"cu_seqlens_k gives key counts in [{lo}, {hi}], but they must lie "
                             f"in [0, {capacity}] (block_table's {block_table.shape[1]} blocks "
                             f"× page size {page_size})")
        if hi > max_seqlen_k:
            raise ValueError(f"max_seqlen_k = {max_seqlen_k} is shorter than a sequence of "
                             f"{hi} keys")
        check_block_table(block_table, lens_k, num_blocks, page_size, capacity)
    sm_scale = check_sm_scale(sm_scale, q.shape[-1])
    batch = q.transpose(0, 1)[None].expand(B, -1, -1, -1)  # (B, H, total_q, D)
    variant = check_variants(batch, causal, window_size, softcap, alibi_slopes, sinks)
    o, lse = _flash_attn_varlen_paged_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                                          int(max_seqlen_q), int(max_seqlen_k), sm_scale,
                                          *_op_args(variant), k_scale, v_scale)
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
    return _variants_forward(q, k, v, sm_scale, variant, impl)


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


@operator(lambda q, *_: (q.new_empty(q.shape),
                         q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)))
def _flash_attn_varlen_paged_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                 cu_seqlens_k: Tensor, block_table: Tensor, max_seqlen_q: int,
                                 max_seqlen_k: int, sm_scale: float, window_left: int,
                                 window_right: int, softcap: float, alibi_slopes: Tensor | None,
                                 sinks: Tensor | None, k_scale: Tensor | None = None,
                                 v_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    variant = Variant((window_left, window_right), softcap, alibi_slopes, sinks)
    return forward_variants_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, sm_scale, variant, block_table=block_table,
                                   kv_scales=None if k_scale is None else (k_scale, v_scale))


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
