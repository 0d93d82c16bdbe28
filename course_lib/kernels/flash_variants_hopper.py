"""FlashAttention-2 forward for Hopper (sm_90) with the variants of open models: sliding window,
softcap, ALiBi, sinks.

For notebooks/15_attention_variants.ipynb. ``course_lib.ops.flash_attn_v2`` with any of
``window_size``, ``softcap``, ``alibi_slopes``, ``sinks`` runs it on sm_90 where lesson 09's
Hopper kernel would run (``course_lib.ops.impl.best_impl``). It computes exactly what the
portable variants' kernel (``flash_variants.py``) computes, with lesson 09's memory plan:

1. TMA descriptors for Q, K, V and O, (B, H, N, D), with tiles past the ends clipped (zeros in,
   nothing out); pipelined K/V tiles, Q in registers, row sums on the tensor cores
   (``ROWSUM_MMA``). Packed sequences (varlen) stay on the portable kernel.
2. **The pinned max, with the band.** The dense kernel pins each row's max after the first key
   block, which every row of a causal block sees. In a band the first block may hold no key of
   some rows, so this kernel first runs, with the running max, the *last block every row sees
   in full* (the one nearest the diagonal) and the band's right edge: the keys nearest each
   row. It pins the row max it reaches there and runs the rest of the band (the left edge, then
   the middle) against it, in any order (nothing is rescaled). The nearest keys matter for
   ALiBi: its bias lets them score up to slope × (BLOCK_M + BLOCK_N − 1) above the full block
   (63.5 at slope 1/2 with 64 × 64 tiles), enough to overflow fp16's P against that block
   alone. A block with no such full key block (a window narrower than the tile), or a weight
   2^(s − m) that still overflows P (above fp16's 65504, about 2^16), runs again with the
   running max.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (B 2, H 16, N 16k, D 128, bf16;
every provider called eagerly, ``do_bench`` median of 7 rounds in turns; TFLOP/s on the visited
area, 4·B·H·D per (query, key) pair a row sees; ``python -m course_lib.bench variants``,
course_lib/data/variants_fwd.json): causal 509 TFLOP/s (FlexAttention 419); window 1024: 400
(FlexAttention 314), 6.49x faster than its own full causal and 6.12x faster than the dense Hopper
kernel's; causal with softcap 495 (FlexAttention 199), with ALiBi 493 (FlexAttention 389), with
sinks 522; the dense flash_attn_v2 causal 539 (Hopper kernel). The tiles, pinned max and row sums
were chosen by timing every candidate in turns on an H100 (``--tiles``,
course_lib/data/variants_hopper_tiles.json); the story: course_lib/data/perf_notes.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib.kernels.attention_common import (
    LOG2E,
    ROWSUM_COLS,
    _epilogue,
    _fresh_state,
    _online_softmax_step,
    _q_block_program,
    _softmax_scores,
    aligned,
    allocate_outputs,
    cdiv,
    dot_precision,
    launch,
    next_pow2,
)
from course_lib.kernels.band import (
    GPU_TANH,
    _band_bounds,
    _head_values,
    _join_sink,
    _key_limits,
    _variant_scores,
    variant_args,
)
from course_lib.kernels.flash_v2_hopper import _cfg, _descriptors, _head_dim_class, tma_ready
from course_lib.masks import Variant


@triton.jit
def _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo, hi, q_offset, sm_scale,
              VARIANT, head_values, j_lo, j_hi, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, PINNED: tl.constexpr, DOT_PRECISION: tl.constexpr,
              ROWSUM_MMA: tl.constexpr):
    """The key blocks [lo, hi) of one query block. With PINNED, ``m_i`` is the pinned reference
    (log2 domain) and stays; else the running max. With MASKED, keys outside j_lo <= j <= j_hi
    count as −inf. With ROWSUM_MMA, ``l_i`` is (BLOCK_M, ROWSUM_COLS), summed as P @ ones."""
    qk_scale = sm_scale * LOG2E
    ones = tl.full([BLOCK_N, ROWSUM_COLS], 1.0, q.dtype)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _variant_scores(qk, offs_m + q_offset, offs_n, sm_scale, VARIANT, head_values,
                           GPU_TANH and DOT_PRECISION != "ieee")[0]
        valid = (offs_n[None, :] >= j_lo[:, None]) & (offs_n[None, :] <= j_hi[:, None])
        if PINNED:
            if MASKED:
                p = tl.math.exp2(tl.where(valid, s * qk_scale - m_i[:, None], float("-inf")))
            else:
                p = tl.math.exp2(s * qk_scale - m_i[:, None])
            if not ROWSUM_MMA:
                l_i += tl.sum(p, 1)
        elif ROWSUM_MMA:
            p, alpha, m_i = _softmax_scores(s, m_i, valid, qk_scale, MASKED)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha[:, None]
        else:
            p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, valid, qk_scale, MASKED)
        v = desc_v.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        if ROWSUM_MMA:
            l_i = tl.dot(p, ones, l_i, input_precision=DOT_PRECISION)  # row sums of P
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_variants_hopper_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE, VARIANT, sm_scale, one, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_IN_REGS: tl.constexpr = True,
    ROWSUM_MMA: tl.constexpr = False, PINNED_MAX: tl.constexpr = False,
    STORE_LSE: tl.constexpr = True,
):
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, LONGEST_FIRST)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past N_Q are zeros
    if Q_IN_REGS:  # (lesson 09: a computed q lives in registers, wgmma's "RS" form)
        q = (q * one).to(desc_q.dtype)
    head_values = _head_values(VARIANT, b, h)  # (ALiBi's slope)
    q_offset = N_K - N_Q
    lo, full_lo, full_hi, hi = _band_bounds(start_m, N_Q, N_K, VARIANT, BLOCK_M, BLOCK_N)
    j_lo, j_hi = _key_limits(offs_m + q_offset, N_K, VARIANT)
    acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)
    redo = full_hi <= full_lo  # no key block that every row sees in full: the running max
    if PINNED_MAX:
        if full_hi > full_lo:
            # the reference: the running max over the full block nearest the diagonal and the
            # band's right edge, the keys nearest each row (ALiBi's bias favours them)
            pin = full_hi - BLOCK_N
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, pin,
                                      hi, q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi,
                                      HEAD_DIM, BLOCK_N, True, False, DOT_PRECISION, ROWSUM_MMA)
            # the rest of the band against it, in any order (nothing is rescaled)
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo,
                                      full_lo, q_offset, sm_scale, VARIANT, head_values, j_lo,
                                      j_hi, HEAD_DIM, BLOCK_N, True, True, DOT_PRECISION,
                                      ROWSUM_MMA)
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                      full_lo, pin, q_offset, sm_scale, VARIANT, head_values,
                                      j_lo, j_hi, HEAD_DIM, BLOCK_N, False, True, DOT_PRECISION,
                                      ROWSUM_MMA)
            # P overflowed (inf; NaN fails the test too): again, with the running max
            redo = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0
    else:
        redo = True
    if redo:
        acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)
        # the band's left edge (masked), the blocks every row sees (no mask), the right edge
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo, full_lo,
                                  q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi, HEAD_DIM,
                                  BLOCK_N, True, False, DOT_PRECISION, ROWSUM_MMA)
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, full_lo,
                                  full_hi, q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi,
                                  HEAD_DIM, BLOCK_N, False, False, DOT_PRECISION, ROWSUM_MMA)
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, full_hi, hi,
                                  q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi, HEAD_DIM,
                                  BLOCK_N, True, False, DOT_PRECISION, ROWSUM_MMA)
    if ROWSUM_MMA:
        l_i = tl.max(l_i, 1)  # every column holds the same sums
    # with sinks: one more term of the denominator, e^{sink}, with no value
    acc, m_i, l_i = _join_sink(acc, m_i, l_i, VARIANT, h)
    o, lse = _epilogue(acc, m_i, l_i)
    desc_o.store([b, h, start_m, 0], o.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    if STORE_LSE:
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# The config each head dim runs. D 128: the fastest of the candidates timed in turns (``python
# -m course_lib.bench variants --tiles``, course_lib/data/variants_hopper_tiles.json). D 64 and
# 256: lesson 09's dense tiles, not measured with the variants, so ``impl=None`` sends them to
# the portable kernel (``MEASURED_HEAD_DIMS``).
VARIANTS_HOPPER_TABLE = {64: _cfg(128, 64, 4, 3, True, False, True),
                         128: _cfg(64, 64, 4, 3, True, False, True),
                         256: _cfg(64, 64, 4, 2, True, False, True)}
MEASURED_HEAD_DIMS = (128,)


def forward_variants_hopper(q, k, v, sm_scale: float, variant: Variant, out=None,
                            store_lse=True, config: triton.Config | None = None, bind=False):
    """``flash_variants.forward_variants`` with the TMA kernel, for power-of-two head dims from
    16 on (a TMA tile spans the whole head dim). ``config``: a config instead of
    ``VARIANTS_HOPPER_TABLE``'s (the tile benchmark, ``python -m course_lib.bench variants
    --tiles``)."""
    B, H, N_Q, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Hopper kernel takes power-of-two head dims of 16 or more, got "
                         f"head dim {D} of q; the portable kernel pads any other")
    H_KV, N_K = k.shape[1], k.shape[2]
    given = (q, k, v)
    q, k, v = (tma_ready(t) for t in given)
    o, lse = allocate_outputs(q, out, store_lse)
    lse_arg = o if lse is None else lse  # (never written without store_lse)
    descs, prepare = _descriptors(q, k, v, o)
    args = (*descs, lse_arg, variant_args(variant)[0], float(sm_scale), 1.0, H, H // H_KV, N_Q,
            N_K, next_pow2(max(N_Q, N_K)))
    meta = dict(HEAD_DIM=D, LONGEST_FIRST=tuple(variant.window) == (-1, 0),
                DOT_PRECISION=dot_precision(q.dtype), STORE_LSE=lse is not None)
    config = config or VARIANTS_HOPPER_TABLE[_head_dim_class(D)]
    bindable = bind and all(a is b for a, b in zip((q, k, v), given)) and aligned(q, k, v, o)
    again = launch(_flash_fwd_variants_hopper_kernel, lambda bm: (cdiv(N_Q, bm), B * H), args,
                   meta, config, prepare=prepare, free=5 if bindable else 0)
    return (o, lse, again) if bind else (o, lse)


__all__ = ["MEASURED_HEAD_DIMS", "VARIANTS_HOPPER_TABLE", "forward_variants_hopper"]
