"""FlashAttention-2 as one differentiable function, and as PyTorch operators.

Introduced in notebooks/08_triton_flash_v2.ipynb (the backward in notebooks/10_backward.ipynb).
The kernels live one version per file in ``course_lib.kernels``: the portable forward
(``flash_v2``), the Hopper forward (``flash_v2_hopper``) and the backward (``flash_bwd``). This
module validates the inputs, picks the forward for the GPU (``best_impl``), and registers both
directions as the operators ``course::flash_attn_fwd`` and ``course::flash_attn_bwd``
(``course_lib.ops.library``): each has a fake implementation (shapes and dtypes only), so
``torch.compile(fullgraph=True)`` traces through them, and the forward's autograd formula calls
the backward operator, saving q, k, v, O and the lse (never P). An eager call with no gradient to
take skips the dispatcher and launches the kernel directly: the same function, less host time.

The fast path (a GPU): an eager call with no gradient and no lse remembers its launch, bound to
everything but the addresses (``course_lib._launch.bind``), in one cache (``_FAST``, filled by
``attention_common.keep``) keyed by what the checks and the compiled kernel read of the call
(``call_key``: shapes, strides, dtypes, devices, the scale; ``causal``, ``impl``). A later call
with that key, 16-byte aligned inputs and no profiler hooks is an allocation of O and one call
into Triton's C launcher.
"""
from __future__ import annotations

import torch
from torch import Tensor

from course_lib import _launch
from course_lib._device import DEVICE
from course_lib._launch import hooks_installed
from course_lib.kernels.attention_common import (
    MAX_GRID_Y,
    call_key,
    empty_output,
)
from course_lib.kernels.flash_bwd import flash_attn_v2_backward
from course_lib.kernels.flash_v2 import forward_portable
from course_lib.kernels.flash_v2_hopper import forward_hopper
from course_lib.ops.impl import HOPPER_MIN_PAIRS, IMPLS, best_impl  # noqa: F401 (re-exported)
from course_lib.ops.library import operator
from course_lib.ops.variants import NO_WINDOW, check_call, flash_attn_variants
from course_lib.validate import check_attention_inputs, check_sm_scale

_FORWARDS = {"portable": forward_portable, "hopper": forward_hopper}  # impl -> its launcher


def _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl=None, out=None, store_lse=True):
    """Forward on validated inputs: returns (o in q's dtype, lse fp32 natural log); o is laid
    out as q is (``attention_common.empty_output``), lse is None without ``store_lse``.

    ``out`` = (o, lse) preallocated (contiguous) lets tests poison the outputs with NaN first.
    """
    impl = impl or best_impl(q, k, v)
    forward = _FORWARDS.get(impl) if isinstance(impl, str) else None
    if forward is None:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    return forward(q, k, v, causal, sm_scale, out=out, store_lse=store_lse)


def flash_attn_v2(q, k, v, causal=False, sm_scale=None, return_lse=False, impl=None, *,
                  window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """FlashAttention-2: softmax(sm_scale·QKᵀ [+ causal mask])·V, fused in one Triton kernel.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D) with H a multiple of H_kv. ``causal`` is
    bottom-right aligned. Returns O (B, H, N_q, D) in q's dtype, and with ``return_lse`` also the
    natural-log log-sum-exp (B, H, N_q) in fp32. O has q's layout: for a q that is a
    (B, N_q, H, D) tensor seen through ``transpose(1, 2)``, ``O.transpose(1, 2)`` is
    contiguous. ``impl`` picks a kernel from ``IMPLS`` (None: the fastest for this GPU).
    Without ``return_lse`` (and no gradient) the kernel stores no lse. Differentiable when an
    input requires grad, and traceable by ``torch.compile`` (the operator
    ``course::flash_attn_fwd``).

    The variants of open models (lesson 15, ``course_lib.ops.variants``), FlashAttention's
    keywords: ``window_size=(left, right)``, query i at key position p = i + N_k − N_q sees keys
    p − left <= j <= p + right (−1: unbounded; ``causal`` is right = 0); ``softcap`` c > 0,
    s = c·tanh(s / c) on the scaled scores; ``alibi_slopes`` (H,) or (B, H) fp32 adds
    −slope·|p − j|; ``sinks`` (H,) fp32, a learnable per-head logit in the softmax's denominator
    with no value (its gradient too). A call with any of them runs the variants' kernels (the
    portable one or, where ``best_impl`` or ``impl`` says so, the TMA one); a row that sees no
    key gets O = 0 and lse = −inf (the sink).
    """
    if window_size is not NO_WINDOW or softcap or alibi_slopes is not None or sinks is not None:
        sm_scale, variant = check_call(q, k, v, causal, sm_scale, window_size, softcap,
                                       alibi_slopes, sinks)
        if not (variant.dense and variant.window in (NO_WINDOW, (-1, 0))):
            if impl is not None and impl not in IMPLS:
                raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
            return flash_attn_variants(q, k, v, sm_scale, variant, return_lse, impl)
        causal = variant.window == (-1, 0)  # plain (causal) attention as a window: dense path
    key = None
    if _REMEMBER and not return_lse and not torch.compiler.is_compiling():
        try:
            key = (call_key(q, k, v, sm_scale), type(causal), causal, impl)
            fast = _FAST.get(key)
        except (AttributeError, TypeError):  # not a tensor, an unhashable argument: the checks
            key = fast = None  # below name it
        if (fast is not None and _launch.FAST
                and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                      or v.requires_grad))
                and not hooks_installed()):
            return fast(q, k, v)
    D = check_attention_inputs(q, k, v)[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"q's batch x heads = {q.shape[0] * q.shape[1]} exceeds {MAX_GRID_Y}, "
                         "the CUDA grid's limit on the axis that carries them; split the batch")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad or torch.compiler.is_compiling():
        o, lse = _flash_attn_fwd(q, k, v, causal, sm_scale, impl or "auto")
    elif key is None:  # eager, no autograd: the kernel directly, without the dispatcher's host
        # time (and without the lse when it is not asked for: one store fewer)
        o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl, store_lse=return_lse)
    else:  # ... and the launch remembered for the next call with this key
        o, lse, again = _FORWARDS[impl or best_impl(q, k, v)](q, k, v, causal, sm_scale,
                                                             store_lse=False, bind=True)
        if again is not None:
            if len(_FAST) >= 256:  # shapes that change at every call must not grow it
                _FAST.clear()
            _FAST[key] = _FastCall(again, o, q)
    return (o, lse) if return_lse else o


class _FastCall:
    """A remembered call: ``self(q, k, v)`` is O, a new tensor laid out as that call's O, and
    the bound launch at the new addresses (lse not stored). Where ``torch.empty_like(q)`` gives
    that O (a dense q: O takes its strides) it is used: it parses no shape, dtype or device, a
    microsecond or two of host time per call."""

    __slots__ = ("again", "shape", "transposed", "dtype", "device", "like")

    def __init__(self, again, o, q):
        self.again = again
        self.transposed = not o.is_contiguous()  # the (B, N_q, H, D) layout seen transposed
        self.shape = tuple(o.transpose(1, 2).shape if self.transposed else o.shape)
        self.dtype, self.device = o.dtype, o.device
        probe = torch.empty_like(q)  # once per remembered call (the key holds q's strides)
        self.like = (probe.shape, probe.stride()) == (o.shape, o.stride())

    def __call__(self, q, k, v):
        if self.like:
            o = torch.empty_like(q)
        else:
            o = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            o = o.transpose(1, 2) if self.transposed else o
        p = o.data_ptr()
        self.again(q.data_ptr(), k.data_ptr(), v.data_ptr(), p, p)
        return o


# The fast path's cache: call key -> _FastCall. On a GPU only: in the interpreter nothing is
# bound, and its time dwarfs the checks'.
_REMEMBER = DEVICE == "cuda"
_FAST: dict = {}


# ---------------------------------------------------------------------------------------------
# The operators: typed functions (course_lib.ops.library), the forward with its autograd formula
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale, _impl = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None, None


def _flash_attn_fwd_fake(q, *_):  # O laid out as the kernels lay it out: as q is
    return empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@operator(_flash_attn_fwd_fake, setup_context=_setup_context, backward=_backward)
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float,
                    impl: str) -> tuple[Tensor, Tensor]:
    """(O, lse) of validated inputs; ``impl`` "auto" picks the kernel for these tensors. The
    kernels take any strides with a unit last one (the launchers copy other inputs), so a
    transposed view costs no copy here."""
    return _flash_attn_v2_forward(q, k, v, causal, sm_scale, None if impl == "auto" else impl)


@operator(lambda do, q, k, v, *_: (q.new_empty(q.shape), k.new_empty(k.shape),
                                   v.new_empty(v.shape)))
def _flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                    causal: bool, sm_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``O = flash_attn_v2(q, k, v)`` for the gradient ``do`` of O."""
    return flash_attn_v2_backward(do, q, k, v, o, lse, causal, sm_scale)
