"""The rules of attention's variants in Triton: which key blocks a program visits, the change to
the scores, where a packed sequence starts, how a sink joins the softmax. The jit twins of
``course_lib.masks``, shared by the variants' forward (``flash_variants.py``), backward
(``flash_variants_bwd.py``) and decode (``decode.py``), so that none imports another kernel file.

Introduced in notebooks/15_attention_variants.ipynb. Speed: not benchmarked on its own; the
kernels that use it state theirs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib.kernels.attention_common import LOG2E


@triton.jit
def _band_bounds(start_m, N_Q, N_K, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks of the query rows [start_m, start_m + BLOCK_M): (lo, full_lo, full_hi, hi),
    multiples of BLOCK_N except ``hi``. [lo, full_lo) and [full_hi, hi) run masked, [full_lo,
    full_hi) unmasked; nothing outside [lo, hi) is loaded (``masks.block_key_range``)."""
    offset = N_K - N_Q
    first = start_m + offset  # key position of the block's first row
    last = tl.minimum(start_m + BLOCK_M, N_Q) - 1 + offset  # ... and of its last real row
    lo = tl.where(LEFT >= 0, tl.maximum(first - LEFT, 0), 0)
    hi = tl.where(RIGHT >= 0, tl.minimum(last + RIGHT + 1, N_K), N_K)
    full_lo = tl.where(LEFT >= 0, tl.maximum(last - LEFT, 0), 0)  # keys every row sees
    full_hi = tl.where(RIGHT >= 0, tl.minimum(first + RIGHT + 1, N_K), N_K)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)  # a block whose rows see no key: every loop empty
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum((full_hi // BLOCK_N) * BLOCK_N, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_limits(p, N_K, LEFT, RIGHT):
    """The keys the queries at key positions ``p`` (a vector) see: j_lo <= j <= j_hi, the window
    and the end of the keys folded into two bounds per row, so that a masked tile costs two
    compares per score (``masks.key_bounds``)."""
    j_lo = tl.where(LEFT >= 0, p - LEFT, 0)
    j_hi = tl.where(RIGHT >= 0, tl.minimum(p + RIGHT, N_K - 1), N_K - 1)
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
def _variant_scores(qk, offs_m, offs_n, q_offset, sm_scale, softcap, slope,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    FAST_TANH: tl.constexpr = False):
    """Raw q·k of a tile -> capped and ALiBi-biased, still in q·k's units (the softmax scales
    them by sm_scale·log2 e): c·tanh(sm_scale·qk / c) / sm_scale − (slope / sm_scale)·|p − j|."""
    s = qk
    if HAS_SOFTCAP:
        s = (softcap / sm_scale) * _tanh(qk * (sm_scale / softcap), FAST_TANH)
    if HAS_ALIBI:
        dist = tl.abs(offs_m[:, None] + q_offset - offs_n[None, :]).to(tl.float32)
        s = s - (slope / sm_scale) * dist
    return s


@triton.jit
def _join_sink(acc, m_i, l_i, sink):
    """The sink logit ``sink`` (natural log, fp32; one per row or one for all) as one more term
    of the denominator, e^{sink}, with no value: (acc, m, l) of the online softmax (exp2 domain)
    after the last key block. A row that saw no key (m = −inf) ends with acc = 0, m = the sink
    and l = 1: O = 0, lse = the sink."""
    sink = sink * LOG2E  # the exp2 domain
    m_new = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_new)  # a row that saw no key: m_i = −inf, α = 0
    l_i = l_i * alpha + tl.math.exp2(sink - m_new)
    return acc * alpha[:, None], m_new, l_i


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


def variant_args(variant, sm_scale: float, unused) -> tuple:
    """A checked ``Variant`` as the variants' kernels take it: the tensors (ALIBI, SINKS),
    ``unused`` (never read) for an absent one; the scalars (stride_alibi_b, sm_scale, softcap);
    the window (LEFT, RIGHT); the constexprs of the variant."""
    window, softcap, alibi, sinks = variant
    tensors = (unused if alibi is None else alibi, unused if sinks is None else sinks)
    alibi_b = alibi.stride(0) if alibi is not None and alibi.ndim == 2 else 0  # 0: one per head
    scalars = (alibi_b, float(sm_scale), float(softcap) or 1.0)  # (1.0: no softcap, never read)
    meta = {"LONGEST_FIRST": tuple(window) == (-1, 0), "HAS_SOFTCAP": softcap > 0,
            "HAS_ALIBI": alibi is not None, "HAS_SINKS": sinks is not None}
    return tensors, scalars, (int(window[0]), int(window[1])), meta
