"""The rules of attention's variants in Triton: which key blocks a program visits, the change to
the scores and its derivative, where a packed sequence starts, how a sink joins the softmax. The
jit twins of ``course_lib.masks``, shared by the variants' forward (``flash_variants.py``,
``flash_variants_hopper.py``), backward (``flash_variants_bwd.py``) and decode (``decode.py``),
so that none imports another kernel file.

A kernel takes a call's variants as one tuple, ``VARIANT`` (``variant_args`` makes it):

    (LEFT, RIGHT, SOFTCAP, ALIBI, ALIBI_STRIDE_B, SINKS)

the window's two sides (−1: unbounded), the cap, the ALiBi slopes and their batch stride, the
sink logits; None where the call has no such variant. Triton compiles a None as a constant, so
``if softcap is not None`` keeps a variant's code out of the kernels of calls without it. The
kernels hand ``VARIANT`` to the functions below and never unpack it: a new variant is a new
field here and in ``course_lib.masks``.

Introduced in notebooks/15_attention_variants.ipynb. Speed: not benchmarked on its own; the
kernels that use it state theirs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib.kernels.attention_common import LOG2E


@triton.jit
def _band_bounds(start_m, N_Q, N_K, VARIANT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks of the query rows [start_m, start_m + BLOCK_M): (lo, full_lo, full_hi, hi),
    multiples of BLOCK_N except ``hi``. [lo, full_lo) and [full_hi, hi) run masked, [full_lo,
    full_hi) unmasked; nothing outside [lo, hi) is loaded (``masks.block_key_range``)."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    offset = N_K - N_Q
    first = start_m + offset  # key position of the block's first row
    last = tl.minimum(start_m + BLOCK_M, N_Q) - 1 + offset  # ... and of its last real row
    lo = tl.where(left >= 0, tl.maximum(first - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(last + right + 1, N_K), N_K)
    full_lo = tl.where(left >= 0, tl.maximum(last - left, 0), 0)  # keys every row sees
    full_hi = tl.where(right >= 0, tl.minimum(first + right + 1, N_K), N_K)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)  # a block whose rows see no key: every loop empty
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum((full_hi // BLOCK_N) * BLOCK_N, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _band_rows(start_n, N_Q, N_K, VARIANT, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The transpose, for the backward's dK/dV: the query rows that see a key of the block
    [start_n, start_n + BLOCK_N), (lo, full_lo, full_hi, hi), in BLOCK_M steps: [full_lo,
    full_hi) see every key of the block (no mask needed), the rest some (``masks.block_row_range``).
    Query i, at key position p = i + N_K − N_Q, sees key j if j − right <= p <= j + left."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    offset = N_K - N_Q
    last = tl.minimum(start_n + BLOCK_N, N_K) - 1  # the block's last real key
    lo = tl.where(right >= 0, tl.maximum(start_n - right - offset, 0), 0)
    hi = tl.where(left >= 0, tl.minimum(last + left - offset + 1, N_Q), N_Q)
    full_lo = tl.where(right >= 0, tl.maximum(last - right - offset, 0), 0)  # sees every key
    full_hi = tl.where(left >= 0, tl.minimum(start_n + left - offset + 1, N_Q), N_Q)
    full_hi = tl.where(start_n + BLOCK_N > N_K, full_lo, full_hi)  # a ragged block: all masked
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.where(start_n < N_K, tl.maximum(hi, lo), lo)  # no key here (varlen): no row
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo), hi)
    full_hi = full_lo + tl.maximum(tl.minimum(full_hi, hi) - full_lo, 0) // BLOCK_M * BLOCK_M
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_limits(p, N_K, VARIANT):
    """The keys the queries at key positions ``p`` (a vector) see: j_lo <= j <= j_hi, the window
    and the end of the keys folded into two bounds per row, so that a masked tile costs two
    compares per score (``masks.key_bounds``)."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    j_lo = tl.where(left >= 0, p - left, 0)
    j_hi = tl.where(right >= 0, tl.minimum(p + right, N_K - 1), N_K - 1)
    return j_lo, j_hi


# On a GPU, tanh is one instruction (PTX ``tanh.approx.f32``, sm_75 and later, relative error
# about 2^-11): used for fp16 and bf16 inputs, whose scores carry larger rounding anyway. fp32
# inputs, and the interpreter (which runs no PTX), take it from one exp2.
GPU_TANH = tl.constexpr(not INTERPRET)


@triton.jit
def _tanh(x, FAST: tl.constexpr = False):
    """tanh(x): with FAST (a GPU only) ``tanh.approx.f32``, else 1 − 2 / (e^{2x} + 1)."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.math.exp2(x * (2 * LOG2E)) + 1.0)


@triton.jit
def _head_values(VARIANT, b, h):
    """What the scores of query head ``h`` of sequence ``b`` take from the variants, loaded once
    per program: ALiBi's slope (0.0 without ALiBi). ``h`` may be a block of heads (the decode's
    rows), every one a real head."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    slope = 0.0
    if alibi is not None:
        slope = tl.load(alibi + b.to(tl.int64) * alibi_b + h).to(tl.float32)
    return slope


@triton.jit
def _variant_scores(qk, pos_a, pos_b, sm_scale, VARIANT, head_values,
                    FAST_TANH: tl.constexpr = False):
    """Raw q·k of a tile -> capped and ALiBi-biased, still in q·k's units (the softmax scales
    them by sm_scale·log2 e): c·tanh(sm_scale·qk / c) / sm_scale − (slope / sm_scale)·|p − j|,
    the tile's rows at key positions ``pos_a``, its columns at ``pos_b`` (S; Sᵀ in the
    backward). Also the factor the backward multiplies dS by (``_chain``): with a softcap,
    ∂s/∂(sm_scale·q·k) = 1 − tanh²(sm_scale·q·k / c). The forward drops it (dead code)."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    slope = head_values
    s = qk
    factor = qk
    if softcap is not None:
        t = _tanh(qk * (sm_scale / softcap), FAST_TANH)
        s = (softcap / sm_scale) * t
        factor = 1.0 - t * t
    if alibi is not None:  # positions made fp32 once per row and column, not per score
        dist = tl.abs(pos_a.to(tl.float32)[:, None] - pos_b.to(tl.float32)[None, :])
        s = s - (slope / sm_scale) * dist
    return s, factor


@triton.jit
def _chain(ds, factor, VARIANT):
    """dS of the raw scores from dS of the changed ones (``_variant_scores``' factor)."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    if softcap is not None:
        ds = ds * factor
    return ds


@triton.jit
def _sink_logit(VARIANT, h):
    """The sink logit of head(s) ``h`` (natural log, fp32), 0.0 without sinks."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    sink = 0.0
    if sinks is not None:
        sink = tl.load(sinks + h).to(tl.float32)
    return sink


@triton.jit
def _join_sink(acc, m_i, l_i, VARIANT, h):
    """With sinks, head ``h``'s sink logit as one more term of the denominator, e^{sink}, with
    no value: (acc, m, l) of the online softmax (exp2 domain) after the last key block. A row
    that saw no key (m = −inf) ends with acc = 0, m = the sink and l = 1: O = 0, lse = the
    sink. Without sinks, (acc, m, l) as they are."""
    left, right, softcap, alibi, alibi_b, sinks = VARIANT
    if sinks is not None:
        sink = _sink_logit(VARIANT, h) * LOG2E  # the exp2 domain
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)  # a row that saw no key: m_i = −inf, α = 0
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sequence(CU_Q, CU_K, b, N_Q, N_K, VARLEN: tl.constexpr):
    """(q_start, k_start, N_Q, N_K) of sequence b. With VARLEN (packed sequences, FlashAttention's
    layout) it is rows CU_Q[b] : CU_Q[b + 1] of q and CU_K[b] : CU_K[b + 1] of k and v; without,
    every sequence starts at row 0 and has the lengths given."""
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        N_Q = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        N_K = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = b.to(tl.int64) * 0
        k_start = q_start
    return q_start, k_start, N_Q, N_K


def variant_args(variant) -> tuple:
    """A checked ``Variant`` as the kernels take it: (VARIANT, KIND). VARIANT is the tuple the
    module's docstring lays out, None for each variant the call lacks; KIND says which fields
    are there (True or False each), the autotuners' key."""
    window, softcap, alibi, sinks = variant
    alibi_b = None if alibi is None else alibi.stride(0) if alibi.ndim == 2 else 0  # 0: per head
    values = (int(window[0]), int(window[1]), float(softcap) if softcap else None, alibi,
              alibi_b, sinks)
    return values, tuple(x is not None for x in values)
