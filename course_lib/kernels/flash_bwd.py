"""FlashAttention-2 backward in Triton: dQ, dK, dV without the N_q × N_k matrix.

Introduced in notebooks/10_backward.ipynb; ``course_lib.ops.flash_attn_v2`` calls the launcher
``flash_attn_v2_backward`` through the operator ``course::flash_attn_bwd``. References: Dao et
al. 2022, "FlashAttention", Appendix B (Algorithm 4, Theorem 5); Dao 2023, "FlashAttention-2",
section 3.1.2; the loop structure of Triton's tutorial 06.

What it computes. With S = sm_scale·QKᵀ (masked), P = exp(S − lse) and O = PV:

    dV = Pᵀ dO                      dP = dO Vᵀ
    dS = P ∘ (dP − delta)           delta_i = rowsum(dO ∘ O)_i
    dQ = sm_scale · dS K            dK = sm_scale · dSᵀ Q

for q, o, do (B, H, N_q, D) and k, v (B, H_kv, N_k, D); dK and dV of a K/V head sum over its GQA
group. P is recomputed block by block from the forward's lse: nothing of size N_q × N_k is kept.

Three kernels, and their grids:

1. ``attention_common._bwd_preprocess_kernel`` (the variants' too), grid (⌈N_q / BLOCK⌉, B·H):
   delta = rowsum(dO ∘ O), lse₂ = lse · log2 e (a row that sees no key: −inf becomes +inf, P = 0).
2. ``_bwd_dkdv_kernel``, grid (⌈N_k / BLOCK_N1⌉, splits·B·H_kv): K and V blocks stay on chip
   while the Q and dO blocks of every query head of the group stream past; four ``tl.dot``
   per block pair (Pᵀ, dPᵀ, dV, dK); dK and dV written once. Where that grid is too small to
   fill the GPU, the group is split over ``splits`` programs writing fp32 partial sums. Its loop
   over a ragged last Q block is compiled only where N_Q leaves one (``EVEN_M``).
3. ``_bwd_dq_kernel``, grid (⌈N_q / BLOCK_M2⌉, B·H): a Q block stays, K and V stream past;
   three ``tl.dot`` (S, dP, dQ).

So seven matmuls per block pair where the reporting convention (FLOPs = 2.5 × forward) counts
five: S and dP are computed twice, in exchange for no atomics and a deterministic result.
``one_pass=True`` runs FlashAttention-2's five-matmul form instead: 0.84 to 1.00 of the two
kernels' speed on an NVIDIA H200 from N 4k on, 0.65 to 0.68 at D 128 and N 1k, where the 64-key
blocks of D 128's named config double its atomic adds (course_lib/data/backward_forms.json); dQ
is not bit-stable.
Causal (bottom-right) programs visit only blocks that can be non-zero: a masked band along the
diagonal, then unmasked blocks; ragged ends are masked.

Head dims: every multiple of 8 from 16 to 256. A kernel spans D rounded up to a power of two
(``HEAD_DIM_PAD``: 40 -> 64) and masks the columns past D: they load as 0, add nothing to any
dot product over D (S, dP, delta) and are never stored. A power-of-two D has no column mask.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (fp16, B·N = 32k,
H·D = 2048; each provider's forward once, then ``torch.autograd.grad`` timed, ``do_bench``
median, the providers in turns, 3 rounds; FLOPs 2.5 × 4·B·H·N²·D, half for causal;
``python -m course_lib.bench backward_forms``, course_lib/data/backward_forms.json):

* D 64, N 16k, non-causal: 360 TFLOP/s, 1.24x SDPA FLASH_ATTENTION, 0.83x SDPA CUDNN_ATTENTION
* D 64, N 16k, causal: 341 TFLOP/s, 1.24x SDPA FLASH_ATTENTION, 0.84x SDPA CUDNN_ATTENTION
* D 128, N 16k, non-causal: 384 TFLOP/s, 1.25x SDPA FLASH_ATTENTION, 0.75x SDPA CUDNN_ATTENTION
* D 128, N 16k, causal: 369 TFLOP/s, 1.19x SDPA FLASH_ATTENTION, 0.75x SDPA CUDNN_ATTENTION

Each kernel's time at each candidate tile: ``backward_forms --tiles``
(course_lib/data/backward_tiles.json).

How the numbers came about: course_lib/data/perf_notes.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from course_lib._device import INTERPRET, refuse_bf16_in_interpreter
from course_lib.kernels.attention_common import (
    AUTOTUNE_MIN_N,
    LOG2E,
    _bwd_preprocess_kernel,
    _load_tile,
    _q_block_program,
    _tile_mask,
    dot_precision,
    interpreter_errstate,
    next_pow2,
)


# 2. dK, dV: a K/V block stays on chip, Q blocks stream past
@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE2, Delta, DQ, qk_scale, sm_scale, offs_n, start_m,
                    num_steps, N_Q, q_offset,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                    CHECK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, ONE_PASS: tl.constexpr):
    """Accumulate dK (unscaled) and dV of one key block over ``num_steps`` Q blocks of one head.

    Q, DO, LSE2, Delta (and DQ) point at the head's first row. With CAUSAL_MASK, Pᵀ is zeroed
    where key j > i + q_offset; with CHECK_M, rows i >= N_Q are masked in the loads (lse₂ = +inf:
    P = 0). With ONE_PASS, each Q block's share of dQ, sm_scale·dS K, is added into DQ (fp32)."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dT_ok, d_ok = offs_d[:, None] < HEAD_DIM, offs_d[None, :] < HEAD_DIM  # Qᵀ's, dO's columns
    for step in range(num_steps):
        offs_m = start_m + step * BLOCK_M + tl.arange(0, BLOCK_M)
        qT_ptrs = Q + offs_m[None, :] * HEAD_DIM + offs_d[:, None]  # (HEAD_DIM_PAD, BLOCK_M)
        do_ptrs = DO + offs_m[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_M, HEAD_DIM_PAD)
        in_m = offs_m < N_Q
        qT = _load_tile(qT_ptrs, in_m[None, :], dT_ok, CHECK_M, PAD_D)
        if CHECK_M:
            lse2 = tl.load(LSE2 + offs_m, mask=in_m, other=float("inf"))
        else:
            lse2 = tl.load(LSE2 + offs_m)
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = (K Qᵀ)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])  # Pᵀ, recomputed from the lse
        if CAUSAL_MASK:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + q_offset, pT, 0.0)
        do = _load_tile(do_ptrs, in_m[:, None], d_ok, CHECK_M, PAD_D)
        if CHECK_M:
            delta = tl.load(Delta + offs_m, mask=in_m, other=0.0)
        else:
            delta = tl.load(Delta + offs_m)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += Pᵀ dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dsT = pT * (dpT - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ - delta)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
        if ONE_PASS:  # this key block's share of the rows' dQ, added to the other blocks'
            dq = tl.dot(tl.trans(dsT.to(qT.dtype)), k, input_precision=DOT_PRECISION)
            tl.atomic_add(DQ + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq * sm_scale,
                          mask=in_m[:, None] & d_ok, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE2, Delta, DK, DV, DQ_ACC,
                     qk_scale, sm_scale, H, H_KV, N_Q, N_K, HEADS_PER_SPLIT, N_BUCKET,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASK_BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, EVEN_M: tl.constexpr,
                     ONE_PASS: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_bhs = tl.program_id(1)  # (split, batch, K/V head), K/V head fastest
    n_bhkv = tl.num_programs(1) // ((H // H_KV) // HEADS_PER_SPLIT)  # B · H_KV
    split = pid_bhs // n_bhkv  # which slice of the GQA group this program sums
    bhk = pid_bhs % n_bhkv
    b = bhk // H_KV
    hk = bhk % H_KV
    group = H // H_KV
    start_n = pid_n * BLOCK_N
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # tl.arange's power of two
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_n = offs_n < N_K
    d_ok = offs_d[None, :] < HEAD_DIM
    acc_ty = Delta.dtype.element_ty

    kv_off = bhk.to(tl.int64) * N_K * HEAD_DIM
    kv_ptrs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_N, HEAD_DIM_PAD)
    n_ok = _tile_mask(in_n[:, None], d_ok, PAD_D)  # columns past HEAD_DIM: 0, never stored
    k = tl.load(K + kv_off + kv_ptrs, mask=n_ok, other=0.0)
    v = tl.load(V + kv_off + kv_ptrs, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=acc_ty)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=acc_ty)

    q_offset = N_K - N_Q
    if CAUSAL:  # the query rows that can see this key block (the same for every head)
        m_lo = tl.minimum(tl.maximum(start_n - q_offset, 0), N_Q)  # first row that sees key start_n
        m_all = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - q_offset, 0), N_Q)  # sees them all
        num_masked = (m_all - m_lo + MASK_BLOCK_M - 1) // MASK_BLOCK_M
        m_full = m_lo + num_masked * MASK_BLOCK_M
    else:
        m_lo = 0
        num_masked = 0
        m_full = 0
    num_full = tl.maximum(N_Q - m_full, 0) // BLOCK_M
    m_tail = m_full + num_full * BLOCK_M
    num_tail = (m_tail < N_Q).to(tl.int32)

    for g in range(HEADS_PER_SPLIT):
        h = hk * group + split * HEADS_PER_SPLIT + g
        row0 = (b * H + h).to(tl.int64) * N_Q
        Qh = Q + row0 * HEAD_DIM
        DOh = DO + row0 * HEAD_DIM
        LSE2h = LSE2 + row0
        Deltah = Delta + row0
        DQh = DQ_ACC + row0 * HEAD_DIM
        if CAUSAL:  # the band along the diagonal: narrow blocks, masked
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE2h, Deltah, DQh, qk_scale,
                                     sm_scale, offs_n, m_lo, num_masked, N_Q, q_offset,
                                     MASK_BLOCK_M, HEAD_DIM, True, True, DOT_PRECISION, ONE_PASS)
        # the rows that see the whole key block: no mask, whole blocks
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE2h, Deltah, DQh, qk_scale, sm_scale,
                                 offs_n, m_full, num_full, N_Q, q_offset,
                                 BLOCK_M, HEAD_DIM, False, False, DOT_PRECISION, ONE_PASS)
        if not EVEN_M:  # the ragged end of the queries (not compiled where there is none)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE2h, Deltah, DQh, qk_scale,
                                     sm_scale, offs_n, m_tail, num_tail, N_Q, q_offset,
                                     BLOCK_M, HEAD_DIM, False, True, DOT_PRECISION, ONE_PASS)

    dk = dk * sm_scale
    out_off = pid_bhs.to(tl.int64) * N_K * HEAD_DIM  # = (split · B·H_KV + bhk) · N_K · D
    tl.store(DK + out_off + kv_ptrs, dk.to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + out_off + kv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok)


# 3. dQ: a Q block stays on chip, K/V blocks stream past
@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, K, V, qk_scale, offs_m, start_n, num_steps,
                  N_K, q_offset,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                  CHECK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Accumulate dQ (unscaled) of one Q block over ``num_steps`` key blocks of its K/V head."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dT_ok = offs_d[:, None] < HEAD_DIM  # with PAD_D: the padding columns, for Kᵀ and Vᵀ
    for step in range(num_steps):
        offs_n = start_n + step * BLOCK_N + tl.arange(0, BLOCK_N)
        kT_ptrs = offs_n[None, :] * HEAD_DIM + offs_d[:, None]  # (HEAD_DIM_PAD, BLOCK_N)
        in_n = offs_n < N_K
        kT = _load_tile(K + kT_ptrs, in_n[None, :], dT_ok, CHECK_N, PAD_D)
        vT = _load_tile(V + kT_ptrs, in_n[None, :], dT_ok, CHECK_N, PAD_D)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if CHECK_N:  # keys past N_K (and, causal, right of the diagonal) contribute nothing
            valid = offs_n[None, :] < N_K
            if CAUSAL_MASK:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + q_offset)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP - delta)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE2, Delta, DQ,
                   qk_scale, sm_scale, H, H_KV, N_Q, N_K, N_BUCKET,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    pid_m, pid_bh, b, h, hk = _q_block_program(H, H // H_KV, CAUSAL)
    start_m = pid_m * BLOCK_M
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # tl.arange's power of two
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_m = offs_m < N_Q
    d_ok = offs_d[None, :] < HEAD_DIM
    acc_ty = Delta.dtype.element_ty

    row0 = pid_bh.to(tl.int64) * N_Q
    q_ptrs = (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]  # (BLOCK_M, HEAD_DIM_PAD)
    m_ok = _tile_mask(in_m[:, None], d_ok, PAD_D)  # columns past HEAD_DIM: 0, never stored
    q = tl.load(Q + q_ptrs, mask=m_ok, other=0.0)
    do = tl.load(DO + q_ptrs, mask=m_ok, other=0.0)
    lse2 = tl.load(LSE2 + row0 + offs_m, mask=in_m, other=float("inf"))
    delta = tl.load(Delta + row0 + offs_m, mask=in_m, other=0.0)
    kv_off = (b * H_KV + hk).to(tl.int64) * N_K * HEAD_DIM
    Kh = K + kv_off
    Vh = V + kv_off
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=acc_ty)

    q_offset = N_K - N_Q
    if CAUSAL:
        n_all = tl.minimum(tl.maximum(start_m + q_offset + 1, 0), N_K)  # keys every row sees
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + q_offset, 0), N_K)  # keys any row sees
    else:
        n_all = N_K
        n_end = N_K
    num_full = n_all // BLOCK_N
    n_masked = num_full * BLOCK_N
    num_masked = (n_end - n_masked + MASK_BLOCK_N - 1) // MASK_BLOCK_N
    # keys every row of the block sees: whole blocks, no mask
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, Kh, Vh, qk_scale, offs_m, 0, num_full,
                       N_K, q_offset, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    # the diagonal band (causal) and the ragged end of the keys: narrow blocks, masked
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, Kh, Vh, qk_scale, offs_m, n_masked, num_masked,
                       N_K, q_offset, MASK_BLOCK_N, HEAD_DIM, CAUSAL, True, DOT_PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + q_ptrs, dq.to(DQ.dtype.element_ty), mask=m_ok)


# A loop that runs no step still costs: compiled after the main loop, the ragged-end loop made the
# dK/dV kernel 15-21% slower (D 64, non-causal, H200; perf_notes.md). Compiled only if needed.
def _no_ragged_rows(args) -> bool:
    """EVEN_M: the ragged-end loop would run no step. Every Q block is whole and, causal, the
    band ends on a BLOCK_M boundary (N_K − N_Q and BLOCK_N multiples of BLOCK_M)."""
    m = args["BLOCK_M"]
    band_ok = (args["N_K"] - args["N_Q"]) % m == 0 and args["BLOCK_N"] % m == 0
    return args["N_Q"] % m == 0 and (band_ok or not args["CAUSAL"])


_bwd_dkdv_kernel = triton.heuristics({"EVEN_M": _no_ragged_rows})(_bwd_dkdv_kernel)


# Configurations: GPU_CONFIGS by (padded) head dim below AUTOTUNE_MIN_N, the autotuner over
# DKDV_CONFIGS and DQ_CONFIGS above it, INTERPRETER_CONFIG in the interpreter (fp32, fp16 and fp64
# there, for torch.autograd.gradcheck). A config passed in is never autotuned.
@dataclass(frozen=True)
class BwdConfig:
    """Blocks and launch settings of the dK/dV program (BLOCK_N1 keys; Q streams past in BLOCK_M1
    rows) and the dQ program (BLOCK_M2 rows; K, V stream past in BLOCK_N2 keys). Along the causal
    diagonal and at ragged ends the streamed blocks shrink to BLOCK / mask_factor: less masking."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    mask_factor: int
    warps_kv: int
    stages_kv: int
    warps_q: int
    stages_q: int
    block_pre: int = 64

    def check(self) -> None:
        """ValueError unless every block is a power of two >= 16, masked blocks included."""
        for name in ("block_m1", "block_n1", "block_m2", "block_n2", "block_pre"):
            b = getattr(self, name)
            if b < 16 or b & (b - 1):
                raise ValueError(f"{name}={b} must be a power of two >= 16")
        for name in ("block_m1", "block_n2"):
            if getattr(self, name) // self.mask_factor < 16:
                raise ValueError(f"{name} / mask_factor must stay >= 16 (tl.dot's smallest tile)")

    def dkdv_blocks(self) -> dict:
        return dict(BLOCK_M=self.block_m1, BLOCK_N=self.block_n1,
                    MASK_BLOCK_M=self.block_m1 // self.mask_factor,
                    num_warps=self.warps_kv, num_stages=self.stages_kv)

    def dq_blocks(self) -> dict:
        return dict(BLOCK_M=self.block_m2, BLOCK_N=self.block_n2,
                    MASK_BLOCK_N=self.block_n2 // self.mask_factor,
                    num_warps=self.warps_q, num_stages=self.stages_q)


# The named config per head dim (used below AUTOTUNE_MIN_N keys). D <= 64: Triton tutorial 06's
# blocks. D 128: the fastest of a sweep of each kernel's tiles on an NVIDIA H200
# (course_lib/data/backward_tiles.json), 64 x 64 tiles in both kernels; the dK/dV kernel's two
# 64 x 128 fp32 accumulators then fit 4 warps' registers. D 256 needs narrow blocks.
GPU_CONFIGS: dict[int, BwdConfig] = {
    16: BwdConfig(32, 128, 128, 32, 2, warps_kv=4, stages_kv=5, warps_q=4, stages_q=5),
    32: BwdConfig(32, 128, 128, 32, 2, warps_kv=4, stages_kv=5, warps_q=4, stages_q=5),
    64: BwdConfig(32, 128, 128, 32, 2, warps_kv=4, stages_kv=5, warps_q=4, stages_q=5),
    128: BwdConfig(64, 64, 64, 64, 2, warps_kv=4, stages_kv=2, warps_q=4, stages_q=2),
    256: BwdConfig(16, 64, 64, 16, 1, warps_kv=8, stages_kv=2, warps_q=8, stages_q=2),
}

# The interpreter's cost is per program and per op, not per FLOP: few, medium blocks.
INTERPRETER_CONFIG = BwdConfig(32, 64, 64, 32, 2, warps_kv=4, stages_kv=1, warps_q=4, stages_q=1)


def _configs(mask_block, rows):
    """triton.Configs from rows (BLOCK_M, BLOCK_N, the masked band's block, warps, stages)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, mask_block: mb}, num_warps=w, num_stages=s)
            for m, n, mb, w, s in rows]


# Autotune candidates, three per head dim and kernel: every config is compiled once per key, so
# the lists stay short. Configs that do not fit (shared memory) are timed as infinitely slow.
DKDV_CONFIGS = _configs("MASK_BLOCK_M", [
    (64, 64, 32, 4, 3), (32, 128, 16, 4, 5), (32, 64, 16, 4, 3),    # D <= 64
    (64, 64, 32, 4, 2), (64, 128, 32, 8, 2), (32, 128, 16, 8, 3),   # D = 128
    (16, 64, 16, 8, 2), (32, 64, 16, 8, 1), (16, 32, 16, 4, 2),     # D = 256
])
DQ_CONFIGS = _configs("MASK_BLOCK_N", [
    (128, 64, 32, 8, 3), (128, 32, 16, 4, 5), (64, 64, 32, 4, 3),   # D <= 64
    (64, 64, 32, 4, 2), (64, 32, 16, 4, 4), (128, 32, 16, 8, 3),    # D = 128
    (64, 16, 16, 8, 2), (32, 32, 16, 4, 2), (64, 32, 16, 8, 1),     # D = 256
])


def keep_bwd_config_for_head_dim(configs, named_args, **kwargs):
    """The autotuner's ``early_config_prune``: the three candidates of a kernel's list for the power
    of two this head dim is padded to (D 72 to 128 share D 128's, 136 to 256 D 256's)."""
    d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
    group = 0 if d <= 64 else (1 if d <= 128 else 2)
    return configs[3 * group:3 * group + 3]


def _autotuned(kernel, configs, key, reset_to_zero=None):
    """``kernel`` autotuned once per ``key`` over the three ``configs`` meant for its head dim
    (``reset_to_zero``: the buffers it adds into, zeroed before each timed run)."""
    prune = {"early_config_prune": keep_bwd_config_for_head_dim}
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune,
                           reset_to_zero=reset_to_zero)(kernel)


_KEY = ["N_BUCKET", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]
_dkdv_tuned = _autotuned(_bwd_dkdv_kernel, DKDV_CONFIGS, _KEY)
_dq_tuned = _autotuned(_bwd_dq_kernel, DQ_CONFIGS, _KEY)
_one_pass_tuned = _autotuned(_bwd_dkdv_kernel, DKDV_CONFIGS, _KEY, reset_to_zero=["DQ_ACC"])


def gpu_config(head_dim: int) -> BwdConfig:
    """``GPU_CONFIGS`` of the power of two this head dim is padded to (D 80: that of D 128)."""
    padded = next_pow2(head_dim)  # the tiles' width: a padded D costs what this one costs
    if padded not in GPU_CONFIGS:
        raise ValueError(f"no backward config for head dim {head_dim}; have {sorted(GPU_CONFIGS)} "
                         "(and every head dim that pads to one of them)")
    return GPU_CONFIGS[padded]


def default_config(head_dim: int) -> BwdConfig:
    """The named configuration used for this head dim (the interpreter has its own)."""
    return INTERPRETER_CONFIG if INTERPRET else gpu_config(head_dim)


def choose_splits(B: int, H_kv: int, group: int, N_k: int, block_n1: int) -> int:
    """The fewest splits of a GQA group (a divisor) that give the dK/dV grid 2 programs per SM."""
    if INTERPRET or group == 1:
        return 1
    programs = triton.cdiv(N_k, block_n1) * B * H_kv
    target = 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for d in range(1, group + 1):
        if group % d == 0 and programs * d >= target:
            return d
    return group


def _gradients(dkdv_kernels, dq_kernels, q, k, v, o, do, lse, strides_q, n_seq, N_q, N_k,
               sm_scale, config, splits, args, one_pass=False):
    """(dq, dk, dv, delta) for ``dO = do``, shared with the variants' backward: the preprocess,
    then the dK/dV and the dQ kernel (each plain and autotuned) over ``n_seq`` sequences of at
    most N_q queries and N_k keys; lse is (B, H, rows), ``strides_q`` q's, o's and do's (batch,
    head, row) strides in rows of D. ``args``: the kernels' other arguments by name, each kernel
    taking those it has (None: a pointer never read). ``one_pass``: the dK/dV kernel adds dQ
    into fp32 zeros (``DQ_ACC``), and no dQ kernel runs."""
    (B, H, rows), D, H_kv = lse.shape, q.shape[-1], k.shape[1]
    group = H // H_kv
    cfg = config or default_config(D)
    cfg.check()
    n_bucket = triton.next_power_of_2(max(N_q, N_k))
    tuned = config is None and not INTERPRET and n_bucket >= AUTOTUNE_MIN_N
    splits = choose_splits(n_seq, H_kv, group, N_k, cfg.block_n1) if splits is None else splits
    if splits < 1 or group % splits:
        raise ValueError(f"splits={splits} must divide the GQA group size {group}")
    q, k, v, o = (t.contiguous() for t in (q, k, v, o))
    do = do.to(q.dtype).contiguous()
    # delta, lse₂ and the partial sums of split dk, dv in fp32 (fp64 for fp64)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = torch.empty((B, H, rows), dtype=acc_dtype, device=q.device)
    lse2 = torch.empty_like(delta)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device) if one_pass else torch.empty_like(q)
    if splits == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk = torch.empty((splits, *k.shape), dtype=acc_dtype, device=q.device)
        dv = torch.empty_like(dk)
    args = {name: delta if a is None else a for name, a in args.items()}
    args.update(DQ_ACC=dq if one_pass else delta, ONE_PASS=one_pass, sm_scale=sm_scale, H=H,
                H_KV=H_kv, N_Q=N_q, N_K=N_k, HEADS_PER_SPLIT=group // splits,
                N_BUCKET=n_bucket, HEAD_DIM=D, DOT_PRECISION=dot_precision(q.dtype))

    def launch(kernels, blocks, grid, *outputs):
        kernel = kernels[1] if tuned else kernels[0]
        given = {**args, **({} if tuned else blocks)}  # (else the autotuner picks the blocks)
        named = {n: a for n, a in given.items() if n in kernel.arg_names or n.startswith("num_")}
        kernel[grid](q, k, v, do, lse2, delta, *outputs, **named)

    with interpreter_errstate():  # exp2 of scores past the mask may overflow before tl.where
        _bwd_preprocess_kernel[(triton.cdiv(rows, cfg.block_pre), B * H)](
            o, do, lse.contiguous(), delta, lse2, rows, H, *strides_q, HEAD_DIM=D,
            BLOCK_M=cfg.block_pre)
        launch(dkdv_kernels, cfg.dkdv_blocks(),
               lambda m: (triton.cdiv(N_k, m["BLOCK_N"]), splits * n_seq * H_kv), dk, dv)
        if not one_pass:
            launch(dq_kernels, cfg.dq_blocks(),
                   lambda m: (triton.cdiv(N_q, m["BLOCK_M"]), n_seq * H), dq)
    if splits > 1:  # the sum of the partials
        dk, dv = dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype)
    return dq.to(q.dtype), dk, dv, delta


def flash_attn_v2_backward(do, q, k, v, o, lse, causal, sm_scale, config: BwdConfig | None = None,
                           splits: int | None = None, one_pass: bool = False):
    """Gradients (dq, dk, dv) of ``O = flash_attn_v2(q, k, v, causal, sm_scale)`` for ``dO = do``;
    lse (B, H, N_q) is the forward's natural-log log-sum-exp (-inf where a row sees no key). dq has
    q's dtype, dk and dv k's. ``config`` and ``splits`` override the defaults (tests, tuning).

    ``one_pass``: FlashAttention-2's form (Dao 2023, section 3.1.2), five matmuls per block pair
    instead of seven: the dK/dV kernel also adds each block's share of dQ into an fp32 buffer
    with atomic adds, and no dQ kernel runs. The order of those adds varies from run to run, so
    dQ's last bits do too; the default (two kernels, no atomics) gives the same bits every run.
    Measured against each other: ``python -m course_lib.bench backward_forms``."""
    B, H, N_q, D = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o {tuple(o.shape)} and do {tuple(do.shape)} must have q's shape "
                         f"{tuple(q.shape)}")
    if tuple(k.shape) != (B, H_kv, N_k, D) or k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, H_kv, N_k, D)")
    if H % H_kv:
        raise ValueError(f"q's {H} heads are not a multiple of k's {H_kv} heads")
    if tuple(lse.shape) != (B, H, N_q):
        raise ValueError(f"lse {tuple(lse.shape)} must be (B, H, N_q) = {(B, H, N_q)}")
    refuse_bf16_in_interpreter(q, k, v, do, names=("q", "k", "v", "do"))
    dq, dk, dv, _ = _gradients(
        (_bwd_dkdv_kernel, _one_pass_tuned if one_pass else _dkdv_tuned),
        (_bwd_dq_kernel, _dq_tuned), q, k, v, o, do, lse, (H * N_q, N_q, 1), B, N_q, N_k,
        sm_scale, config, splits, {"qk_scale": sm_scale * LOG2E.value, "CAUSAL": bool(causal)},
        one_pass=bool(one_pass))
    return dq, dk, dv


__all__ = ["flash_attn_v2_backward", "BwdConfig", "GPU_CONFIGS",
           "INTERPRETER_CONFIG", "default_config", "gpu_config", "choose_splits"]
