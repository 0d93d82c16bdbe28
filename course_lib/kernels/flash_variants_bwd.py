"""FlashAttention-2 backward for the attention of open models: window, softcap, ALiBi, sinks.

For notebooks/15_attention_variants.ipynb: lesson 10's backward (``flash_bwd.py``) with the
forward's two changes (``flash_variants.py``):

1. **Which blocks a program visits.** A dQ program visits the key blocks ``_band_bounds`` names,
   as the forward does: the band's two masked edges first, then the keys every row sees,
   unmasked. A dK/dV program visits the transpose, the query rows that see any or all of its keys
   (``band._band_rows``, the jit twin of ``course_lib.masks.block_row_range``), in one loop
   that masks only the steps where some row misses some key. Both keep the loop without a mask
   last: the backward took 18–22% less time than with an edge loop compiled after it
   (course_lib/data/variants_bwd_loops.json, perf_notes.md).
2. **The scores' derivative.** P is recomputed from the forward's lse exactly as the forward
   made it (``band._variant_scores``, which also returns the factor below; ``band._chain``
   applies it), and dS = P ∘ (dP − delta), delta_i = dO_i · O_i, is the gradient of
   the loss with respect to the final score s = c·tanh(sm_scale·q·k / c) − slope·|p − j|. Then

       softcap:  ∂s/∂(sm_scale·q·k) = 1 − tanh²(sm_scale·q·k / c)   (dS is multiplied by it)
       ALiBi:    the bias does not depend on q or k: dS is unchanged
       sinks:    d sink_h = −Σ_i P_i,sink · delta_i, P_i,sink = e^{sink_h − lse_i}

   The sink has no value, so dP has no sink column and delta is still rowsum(dO ∘ O); d sink is
   a reduction in PyTorch of the lse and delta, after the kernels: no extra pass over Q, K or V.

Packed sequences (``VARLEN``, FlashAttention's layout: Q, O, dO (total_q, H, D), K, V (total_k,
H_kv, D)) are read where they lie, no contiguous input copied, and dQ, dK, dV written in that
layout. GQA, padded head dims, the configs and the splits of a GQA group are lesson 10's.
``course_lib.reference.attention_variants`` (autograd) is the ground truth.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (B 2, H 16, N 16k, D 128, bf16;
only the backward timed: ``torch.autograd.grad`` of a forward made once, for every provider;
``do_bench`` median of 7 rounds in turns; TFLOP/s on the visited area, 2.5 × 4·B·H·D per (query,
key) pair a row sees; ``python -m course_lib.bench variants --backward``,
course_lib/data/variants_bwd.json): causal 400 TFLOP/s (FlexAttention 382); window 1024 297 TFLOP/s
(FlexAttention 293); causal with softcap 314 TFLOP/s (FlexAttention 199); causal with ALiBi 394
TFLOP/s (FlexAttention 381); causal with sinks 392; the dense backward (flash_bwd) causal 391.
Packed sequences (``--varlen``, course_lib/data/variants_varlen.json, the same GPU and versions,
forward and backward): 64 causal sequences of random lengths 1 to 4096 (mean 2191): forward 353
TFLOP/s against the dense kernel's 357 at the mean length, backward 285 against 297 (the packed
layout read in place). The story: course_lib/data/perf_notes.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib._device import refuse_bf16_in_interpreter
from course_lib.kernels import band
from course_lib.kernels.attention_common import LOG2E, _load_tile, _q_block_program, _tile_mask
from course_lib.kernels.band import (
    GPU_TANH,
    _band_bounds,
    _band_rows,
    _chain,
    _head_values,
    _key_limits,
    _sequence,
    _variant_scores,
)
from course_lib.kernels.flash_bwd import DKDV_CONFIGS, DQ_CONFIGS, BwdConfig, _autotuned, _gradients
from course_lib.masks import Variant


@triton.jit
def _dkdv_rows(dk, dv, k, v, Q, DO, LSE2, Delta, stride_qm, offs_n, lo, full_lo, full_hi, hi,
               N_Q, N_K, q_offset, sm_scale, VARIANT, head_values, BLOCK_M: tl.constexpr,
               HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK (in units of sm_scale) and dV of one key block over the query rows [lo, hi) of one
    head, transposed (keys along the rows) as lesson 10's ``_bwd_dkdv_inner``, in one loop of
    BLOCK_M rows: the band's mask only on steps outside [full_lo, full_hi), where some row misses
    some key. Q, DO, LSE2, Delta point at the head's (sequence's) first row, Q's and DO's rows
    stride_qm rows of D apart; rows past N_Q load as zeros (lse +inf: P = 0)."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dT_ok, d_ok = offs_d[:, None] < HEAD_DIM, offs_d[None, :] < HEAD_DIM
    qk_scale = sm_scale * LOG2E
    row = stride_qm * HEAD_DIM  # elements from one row to the next
    for start_m in range(lo, hi, BLOCK_M):
        offs_i = tl.arange(0, BLOCK_M)
        offs_m = start_m + offs_i
        in_m = offs_m < N_Q
        block = tl.cast(start_m, tl.int64) * row  # the first row in int64, the rest in int32
        qT = _load_tile(Q + block + offs_i[None, :] * row + offs_d[:, None], in_m[None, :],
                        dT_ok, True, PAD_D)  # (HEAD_DIM_PAD, BLOCK_M)
        lse2 = tl.load(LSE2 + offs_m, mask=in_m, other=float("inf"))
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = K Qᵀ
        sT, factorT = _variant_scores(qkT, offs_n, offs_m + q_offset, sm_scale, VARIANT,
                                      head_values, GPU_TANH and DOT_PRECISION != "ieee")
        pT = tl.math.exp2(sT * qk_scale - lse2[None, :])  # Pᵀ, recomputed from the lse
        if (start_m < full_lo) | (start_m >= full_hi):  # the band: p − left <= j <= p + right
            j_lo, j_hi = _key_limits(offs_m + q_offset, N_K, VARIANT)
            pT = tl.where((offs_n[:, None] >= j_lo[None, :]) & (offs_n[:, None] <= j_hi[None, :]),
                          pT, 0.0)
        do = _load_tile(DO + block + offs_i[:, None] * row + offs_d[None, :], in_m[:, None], d_ok,
                        True, PAD_D)  # (BLOCK_M, HEAD_DIM_PAD)
        delta = tl.load(Delta + offs_m, mask=in_m, other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += Pᵀ dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dsT = _chain(pT * (dpT - delta[None, :]), factorT, VARIANT)  # dSᵀ = Pᵀ ∘ (dPᵀ − delta)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_variants_kernel(
    Q, K, V, DO, LSE2, Delta, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh,
    split_rows, VARIANT, sm_scale, H, H_KV, N_Q, N_K, HEADS_PER_SPLIT, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT_KIND: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Strides count rows of HEAD_DIM elements (every address a multiple of HEAD_DIM: a head dim
    like 40 keeps 16-byte loads): (0, 1, heads) packed, (heads·N, N, 1) in (B, heads, N, D). Row r
    of (b, h) starts at element (b·stride_qb + h·stride_qh + r·stride_qm)·HEAD_DIM in Q and DO,
    of (b, h_kv) at (b·stride_kb + h_kv·stride_kh + r·stride_kn)·HEAD_DIM in K, V, DK, DV (split
    s: split_rows·s rows further), in LSE2 and Delta at b·stride_lb + h·stride_lh + r. With
    VARLEN, b is a sequence and r counts from its start in ``cu_seqlens``."""
    pid_n = tl.program_id(0)
    pid_bhs = tl.program_id(1)  # (split, batch, K/V head), K/V head fastest
    group = H // H_KV
    n_bhkv = tl.num_programs(1) // (group // HEADS_PER_SPLIT)  # B · H_KV
    split = pid_bhs // n_bhkv
    b = (pid_bhs % n_bhkv) // H_KV
    hk = pid_bhs % H_KV
    q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, b, N_Q, N_K, VARLEN)
    start_n = pid_n * BLOCK_N
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc_ty = Delta.dtype.element_ty
    kv_row = (b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
              + (k_start + start_n) * stride_kn)  # the block's first key, in int64
    kv_ptrs = tl.arange(0, BLOCK_N)[:, None] * (stride_kn * HEAD_DIM) + offs_d[None, :]
    n_ok = _tile_mask(offs_n[:, None] < N_K, offs_d[None, :] < HEAD_DIM, PAD_D)
    k = tl.load(K + kv_row * HEAD_DIM + kv_ptrs, mask=n_ok, other=0.0)  # (BLOCK_N, HEAD_DIM_PAD)
    v = tl.load(V + kv_row * HEAD_DIM + kv_ptrs, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=acc_ty)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=acc_ty)
    q_offset = N_K - N_Q
    # the rows that see some key of this block, in BLOCK_M steps: the same for every head of the
    # group
    lo, full_lo, full_hi, hi = _band_rows(start_n, N_Q, N_K, VARIANT, BLOCK_N, BLOCK_M)
    for g in range(HEADS_PER_SPLIT):
        h = hk * group + split * HEADS_PER_SPLIT + g
        row0 = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qm
        lrow = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
        head_values = _head_values(VARIANT, b, h)  # (ALiBi's slope)
        dk, dv = _dkdv_rows(dk, dv, k, v, Q + row0 * HEAD_DIM, DO + row0 * HEAD_DIM, LSE2 + lrow,
                            Delta + lrow, stride_qm, offs_n, lo, full_lo, full_hi, hi, N_Q, N_K,
                            q_offset, sm_scale, VARIANT, head_values, BLOCK_M, HEAD_DIM,
                            DOT_PRECISION)
    out = (split.to(tl.int64) * split_rows + kv_row) * HEAD_DIM
    tl.store(DK + out + kv_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + out + kv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok)


@triton.jit
def _dq_keys(dq, q, do, lse2, delta, K, V, stride_kn, offs_m, lo, hi, N_K, q_offset, sm_scale,
             VARIANT, head_values, j_lo, j_hi, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ (in units of sm_scale) of one query block over the keys [lo, hi) of its K/V head; K and
    V point at the head's (sequence's) first key, their rows stride_kn rows of HEAD_DIM apart."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dT_ok = offs_d[:, None] < HEAD_DIM
    qk_scale = sm_scale * LOG2E
    row = stride_kn * HEAD_DIM  # elements from one key to the next
    for start_n in range(lo, hi, BLOCK_N):
        offs_j = tl.arange(0, BLOCK_N)
        offs_n = start_n + offs_j
        block = tl.cast(start_n, tl.int64) * row  # the first key in int64, the rest in int32
        kT_ptrs = offs_j[None, :] * row + offs_d[:, None]  # (HEAD_DIM_PAD, BLOCK_N)
        in_n = offs_n[None, :] < N_K
        kT = _load_tile(K + block + kT_ptrs, in_n, dT_ok, MASKED, PAD_D)
        vT = _load_tile(V + block + kT_ptrs, in_n, dT_ok, MASKED, PAD_D)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        s, factor = _variant_scores(qk, offs_m + q_offset, offs_n, sm_scale, VARIANT,
                                    head_values, GPU_TANH and DOT_PRECISION != "ieee")
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # the band, for each row (j_lo, j_hi: _key_limits)
            p = tl.where((offs_n[None, :] >= j_lo[:, None]) & (offs_n[None, :] <= j_hi[:, None]),
                         p, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = _chain(p * (dp - delta[:, None]), factor, VARIANT)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_variants_kernel(
    Q, K, V, DO, LSE2, Delta, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_lb, stride_lh,
    VARIANT, sm_scale, H, H_KV, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_BLOCK_N: tl.constexpr, LONGEST_FIRST: tl.constexpr, VARIANT_KIND: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Strides as ``_bwd_dkdv_variants_kernel``'s (DQ has Q's)."""
    pid_m, pid_bh, b, h, hk = _q_block_program(H, H // H_KV, LONGEST_FIRST)
    q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, b, N_Q, N_K, VARLEN)
    start_m = pid_m * BLOCK_M
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_m = offs_m < N_Q
    row0 = (b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            + (q_start + start_m) * stride_qm)  # the block's first row, in int64
    q_ptrs = tl.arange(0, BLOCK_M)[:, None] * (stride_qm * HEAD_DIM) + offs_d[None, :]
    m_ok = _tile_mask(in_m[:, None], offs_d[None, :] < HEAD_DIM, PAD_D)
    q = tl.load(Q + row0 * HEAD_DIM + q_ptrs, mask=m_ok, other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)
    do = tl.load(DO + row0 * HEAD_DIM + q_ptrs, mask=m_ok, other=0.0)
    lrow = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    lse2 = tl.load(LSE2 + lrow + offs_m, mask=in_m, other=float("inf"))
    delta = tl.load(Delta + lrow + offs_m, mask=in_m, other=0.0)
    kv_row = b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    Kh, Vh = K + kv_row * HEAD_DIM, V + kv_row * HEAD_DIM
    head_values = _head_values(VARIANT, b, h)  # (ALiBi's slope)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=Delta.dtype.element_ty)
    q_offset = N_K - N_Q
    lo, full_lo, full_hi, hi = _band_bounds(start_m, N_Q, N_K, VARIANT, BLOCK_M, MASK_BLOCK_N)
    hi = tl.where(start_m < N_Q, hi, lo)  # a block past its sequence's end (varlen): no key
    full_lo = tl.minimum(full_lo, hi)
    full_hi = full_lo + tl.maximum(tl.minimum(full_hi, hi) - full_lo, 0) // BLOCK_N * BLOCK_N
    j_lo, j_hi = _key_limits(offs_m + q_offset, N_K, VARIANT)
    # the band's two edges (masked, narrow steps), then the keys every row sees (no mask): the
    # loop without a mask last (the module's docstring says why)
    dq = _dq_keys(dq, q, do, lse2, delta, Kh, Vh, stride_kn, offs_m, lo, full_lo, N_K, q_offset,
                  sm_scale, VARIANT, head_values, j_lo, j_hi, MASK_BLOCK_N, HEAD_DIM, True,
                  DOT_PRECISION)
    dq = _dq_keys(dq, q, do, lse2, delta, Kh, Vh, stride_kn, offs_m, full_hi, hi, N_K, q_offset,
                  sm_scale, VARIANT, head_values, j_lo, j_hi, MASK_BLOCK_N, HEAD_DIM, True,
                  DOT_PRECISION)
    dq = _dq_keys(dq, q, do, lse2, delta, Kh, Vh, stride_kn, offs_m, full_lo, full_hi, N_K,
                  q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi, BLOCK_N, HEAD_DIM, False,
                  DOT_PRECISION)
    tl.store(DQ + row0 * HEAD_DIM + q_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok)


_KEY = ["N_BUCKET", "HEAD_DIM", "VARIANT_KIND", "VARLEN", "DOT_PRECISION"]
# the dense dK/dV kernel's candidates without its narrower masked block (one step size here)
_dkdv_tuned = _autotuned(_bwd_dkdv_variants_kernel, [
    triton.Config({n: b for n, b in c.kwargs.items() if n != "MASK_BLOCK_M"},
                  num_warps=c.num_warps, num_stages=c.num_stages) for c in DKDV_CONFIGS], _KEY)
_dq_tuned = _autotuned(_bwd_dq_variants_kernel, DQ_CONFIGS, _KEY + ["LONGEST_FIRST"])
_STRIDES = ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
            "stride_lb", "stride_lh")


def _backward(do, q, k, v, o, lse, sm_scale, variant, cu, N_q, N_k, config, splits):
    """Both public functions' backward; ``cu`` (cu_seqlens_q, cu_seqlens_k) for packed tensors."""
    # (batch, head, row) strides in rows of D of q, o, do, dq; of k, v, dk, dv; of lse2, delta
    if cu:  # packed: token t, head h is row t·H + h; sequence b starts at token cu_seqlens[b]
        (rows_q, H), (rows_k, H_kv), B = q.shape[:2], k.shape[:2], 1
        strides_q, strides_k = (0, 1, H), (0, 1, H_kv)
    else:
        (B, H, rows_q), (H_kv, rows_k) = q.shape[:3], k.shape[1:3]
        strides_q, strides_k = (H * rows_q, rows_q, 1), (H_kv * rows_k, rows_k, 1)
    strides = (*strides_q, *strides_k, 0 if cu else H * rows_q, rows_q)
    refuse_bf16_in_interpreter(q, k, v, names=("q", "k", "v"))  # do is cast to q's dtype
    values, kind = band.variant_args(variant)
    cu_q, cu_k = cu or (None, None)
    lse = lse.contiguous().reshape(B, H, rows_q)
    dq, dk, dv, delta = _gradients(
        (_bwd_dkdv_variants_kernel, _dkdv_tuned), (_bwd_dq_variants_kernel, _dq_tuned), q, k, v,
        o, do, lse, strides_q, len(cu_q) - 1 if cu else B, N_q, N_k, sm_scale, config, splits,
        dict(zip(_STRIDES, strides), CU_Q=cu_q, CU_K=cu_k, split_rows=k.numel() // q.shape[-1],
             VARIANT=values, VARIANT_KIND=kind, VARLEN=bool(cu),
             LONGEST_FIRST=tuple(variant.window) == (-1, 0)))
    dsinks = None
    sinks = variant.sinks
    if sinks is not None:  # d sink_h = −Σ_i e^{sink_h − lse_i} delta_i, over batch and rows
        p_sink = torch.exp(sinks.to(delta.dtype)[None, :, None] - lse.to(delta.dtype))
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks


def backward_variants(do, q, k, v, o, lse, sm_scale: float, variant: Variant,
                      config: BwdConfig | None = None, splits: int | None = None):
    """Gradients (dq, dk, dv, dsinks: None without sinks) of ``forward_variants`` for ``dO = do``;
    lse (B, H, N_q) is the forward's (natural log, with the sink), ``variant`` already checked."""
    return _backward(do, q, k, v, o, lse, sm_scale, variant, None, q.shape[2], k.shape[2],
                     config, splits)


def backward_variants_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                             max_seqlen_k: int, sm_scale: float, variant: Variant,
                             config: BwdConfig | None = None):
    """Gradients (dq, dk, dv, dsinks) of ``forward_variants_varlen``, in its packed layout."""
    return _backward(do, q, k, v, o, lse, sm_scale, variant, (cu_seqlens_q, cu_seqlens_k),
                     int(max_seqlen_q), int(max_seqlen_k), config, 1)


__all__ = ["backward_variants", "backward_variants_varlen"]
