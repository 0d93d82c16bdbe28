"""FlashAttention-2 forward for Hopper (sm_90): the FlashAttention-3 ideas that Triton exposes.

Introduced in notebooks/09_hopper.ipynb. It computes what the portable kernel (``flash_v2.py``)
computes, on the same grid; ``course_lib.ops.flash_attn_v2`` picks it on sm_90 for head dims of
64 and more when the inputs suit TMA. The launcher ``forward_hopper`` runs one config per head
dim, the one that measured best (``hopper_config``). Head dims are powers of two here (a TMA tile
spans the whole head dim); the portable kernel pads the others. The memory plan:

1. TMA descriptors. Q, K, V and O are described once on the host as (B, H, N, D) tensors
   (``TensorDescriptor``); a tile load is one bulk copy issued by one thread, clipped at the
   tensor's bounds, so ragged N_q and N_k need no load masks. Inputs must have a contiguous last
   dim and 16-byte-aligned strides (``tma_compatible``).
2. Software pipelining: ``num_stages`` K/V tiles in flight while the tensor cores (wgmma, HGMMA
   in the SASS) work on the current one; each stage costs 2·BLOCK_N·D·2 bytes of shared memory.
3. Q in registers (``Q_IN_REGS``): Q passes through registers once (times a run-time 1.0), so
   every QKᵀ reads only K from shared memory, and Q's buffer is free for the K/V stages.
4. Row sums on the tensor cores (``ROWSUM_MMA``, D 128): l accumulates P·1 next to P·V.
5. Pinned max (``PINNED_MAX``, the course's own change): after the first key block its row max
   stays the reference, so there is no row max, no α and no rescaling per block; a later score
   more than 16 (log2) above it makes P inf, and the program reruns with the running max.

Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22 (fp16, B·N = 32k,
H·D = 2048; every provider called eagerly, ``do_bench`` median of 5 interleaved rounds; FLOPs
4·B·H·N²·D, half for causal; course_lib/data/attention_fwd.json):

* D 64, N 16k, non-causal: 515 TFLOP/s, 1.64x SDPA FLASH_ATTENTION, 1.17x SDPA CUDNN_ATTENTION
* D 64, N 16k, causal: 468 TFLOP/s, 1.51x SDPA FLASH_ATTENTION, 1.05x SDPA CUDNN_ATTENTION
* D 128, N 16k, non-causal: 554 TFLOP/s, 1.60x SDPA FLASH_ATTENTION, 0.95x SDPA CUDNN_ATTENTION
* D 128, N 16k, causal: 553 TFLOP/s, 1.67x SDPA FLASH_ATTENTION, 1.02x SDPA CUDNN_ATTENTION

What each change bought, and what was tried and dropped: notebooks/09a_hopper_case_study.ipynb
and course_lib/data/perf_notes.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from course_lib.kernels.attention_common import (
    LOG2E,
    ROWSUM_COLS,
    _causal_bounds,
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


@triton.jit
def _key_block_scores(q, desc_k, b, h_kv, start_n, offs_m, N_K, q_offset,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """S = Q K_j^T for the key block at ``start_n``, and which of its entries count (keys past
    N_K, and with CAUSAL keys after the query, do not)."""
    k = desc_k.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    valid = offs_n[None, :] < N_K
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + q_offset)
    return qk, valid


@triton.jit
def _accumulate_pv(acc, l_i, p, desc_v, b, h_kv, start_n, ones, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWSUM_MMA: tl.constexpr):
    """acc += P V_j, with P rounded to V's dtype. With ROWSUM_MMA the same P gives the row
    sums on the tensor cores too: l += P @ ones."""
    v = desc_v.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    p = p.to(v.dtype)
    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    if ROWSUM_MMA:
        l_i = tl.dot(p, ones, l_i, input_precision=DOT_PRECISION)  # row sums of P
    return acc, l_i


@triton.jit
def _fwd_inner_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo, hi, N_K, q_offset,
                   qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   ROWSUM_MMA: tl.constexpr):
    """One key range of the loop, with the running max. With ROWSUM_MMA, ``l_i`` is a
    (BLOCK_M, ROWSUM_COLS) tile of row sums, accumulated by the tensor cores as P @ ones."""
    ones = tl.full([BLOCK_N, ROWSUM_COLS], 1.0, q.dtype)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        qk, valid = _key_block_scores(q, desc_k, b, h_kv, start_n, offs_m, N_K, q_offset,
                                      HEAD_DIM, BLOCK_N, CAUSAL, DOT_PRECISION)
        if ROWSUM_MMA:
            p, alpha, m_i = _softmax_scores(qk, m_i, valid, qk_scale, MASKED)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha[:, None]
        else:
            p, m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, valid, qk_scale, MASKED)
        acc, l_i = _accumulate_pv(acc, l_i, p, desc_v, b, h_kv, start_n, ones, HEAD_DIM, BLOCK_N,
                                  DOT_PRECISION, ROWSUM_MMA)
    return acc, m_i, l_i


@triton.jit
def _fwd_inner_pinned(acc, l_i, m_ref, q, desc_k, desc_v, b, h_kv, offs_m, lo, hi, N_K, q_offset,
                      qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      ROWSUM_MMA: tl.constexpr):
    """A key range against a pinned reference ``m_ref`` (log2 domain): p = 2^(s - m_ref). No
    row max, no α, no rescaling of ``acc``: the exponentials start as soon as S arrives and P @ V
    as soon as P is ready. p may exceed 1 (up to 2^16 in fp16); the caller checks for overflow."""
    ones = tl.full([BLOCK_N, ROWSUM_COLS], 1.0, q.dtype)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        qk, valid = _key_block_scores(q, desc_k, b, h_kv, start_n, offs_m, N_K, q_offset,
                                      HEAD_DIM, BLOCK_N, CAUSAL, DOT_PRECISION)
        if MASKED:
            p = tl.math.exp2(tl.where(valid, qk * qk_scale - m_ref[:, None], float("-inf")))
        else:
            p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
        if not ROWSUM_MMA:
            l_i += tl.sum(p, 1)
        acc, l_i = _accumulate_pv(acc, l_i, p, desc_v, b, h_kv, start_n, ones, HEAD_DIM, BLOCK_N,
                                  DOT_PRECISION, ROWSUM_MMA)
    return acc, l_i


@triton.jit
def _flash_fwd_v2_hopper_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,
    qk_scale, one, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_IN_REGS: tl.constexpr = True,
    ROWSUM_MMA: tl.constexpr = False, PINNED_MAX: tl.constexpr = False,
    STORE_LSE: tl.constexpr = True,
):
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, CAUSAL)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past N_Q are zeros
    if Q_IN_REGS:
        # q · 1.0 is exact, but the compiler cannot fold a run-time 1.0 away: q becomes a value
        # computed in registers, and wgmma takes it from there (the "RS" form). Each QK^T
        # wgmma then reads only K from shared memory, and Q's 128 x D tile frees its buffer.
        q = (q * one).to(desc_q.dtype)
    acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)

    lo_masked, hi = _causal_bounds(start_m, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    q_offset = N_K - N_Q
    redo = True
    if PINNED_MAX:
        # the first key block as usual; its row max becomes the reference for the rest
        acc, m_i, l_i = _fwd_inner_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                       0, tl.minimum(hi, BLOCK_N), N_K, q_offset, qk_scale,
                                       HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION, ROWSUM_MMA)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)  # rows that see no key keep p = 0
        acc, l_i = _fwd_inner_pinned(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                     BLOCK_N, lo_masked, N_K, q_offset, qk_scale,
                                     HEAD_DIM, BLOCK_N, False, CAUSAL, DOT_PRECISION, ROWSUM_MMA)
        acc, l_i = _fwd_inner_pinned(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                     tl.maximum(lo_masked, BLOCK_N), hi, N_K, q_offset, qk_scale,
                                     HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION, ROWSUM_MMA)
        # a later score more than 16 (log2) above the reference made P overflow (fp16: inf):
        # then, and only then, this program runs again with the running max
        redo = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0  # NaN fails the test too
    if redo:  # the running max, from the start (without PINNED_MAX the only path)
        acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)
        acc, m_i, l_i = _fwd_inner_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                       0, lo_masked, N_K, q_offset, qk_scale,
                                       HEAD_DIM, BLOCK_N, False, CAUSAL, DOT_PRECISION, ROWSUM_MMA)
        acc, m_i, l_i = _fwd_inner_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                       lo_masked, hi, N_K, q_offset, qk_scale,
                                       HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION, ROWSUM_MMA)
    if ROWSUM_MMA:
        l_i = tl.max(l_i, 1)  # every column holds the same sums

    o, lse = _epilogue(acc, m_i, l_i)
    desc_o.store([b, h, start_m, 0], o.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    if STORE_LSE:
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


def _set_block_shapes(nargs):
    """Autotune pre-hook: the descriptors' tile shapes follow the config being tried."""
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [1, 1, bm, d]
    nargs["desc_o"].block_shape = [1, 1, bm, d]
    nargs["desc_k"].block_shape = [1, 1, bn, d]
    nargs["desc_v"].block_shape = [1, 1, bn, d]


def _cfg(bm, bn, warps, stages, q_in_regs=True, rowsum_mma=False, pinned_max=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "Q_IN_REGS": q_in_regs,
                          "ROWSUM_MMA": rowsum_mma, "PINNED_MAX": pinned_max},
                         num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes)


# The config each head dim runs (``hopper_config``), causal or not: the best, or within the
# runs' spread of the best, at every shape measured among the candidates the benchmarks time
# (``course_lib.bench.kernel_configs.HOPPER_CONFIGS``; course_lib/data/hopper_tiles.json,
# hopper_rowsum.json, hopper_pinned.json). D 64: 128 x 64 tiles, two programs per SM. D 128:
# 64 x 64, two programs per SM overlapping one's softmax with the other's MMAs, row sums on the
# tensor cores. D 256: 64 x 64 with 2 stages, what fits the 227 KB a block may use (a 32 KB Q
# tile and 2 stages of 32 KB K and V tiles).
HOPPER_TABLE = {64: _cfg(128, 64, 4, 3, True, False, True),
                128: _cfg(64, 64, 4, 3, True, True, True),
                256: _cfg(64, 64, 4, 2, False, False, True)}
# Causal at D 64 and at most SHORT_CAUSAL_N keys: 64-row tiles. Twice the programs, and half the
# masked diagonal: 2-14% faster at every causal shape up to 2k keys, mixed at 4k, 2-7% slower
# from 8k on (B 1-32, H 32, H_kv 8, fp16 and bf16; course_lib/data/hopper_short_causal.json).
SHORT_CAUSAL_N = 2048
SHORT_CAUSAL_64 = _cfg(64, 64, 4, 3, True, False, True)


def _head_dim_class(d: int) -> int:
    """The ``HOPPER_TABLE`` row a head dim uses: 64, 128 or 256."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def hopper_config(head_dim: int, causal: bool, n_bucket: int) -> triton.Config:
    """The config the kernel runs for this head dim, causal flag and length bucket (the next
    power of two of the longer side): ``HOPPER_TABLE``'s, or ``SHORT_CAUSAL_64`` for causal
    D 64 up to ``SHORT_CAUSAL_N`` keys. A table, no autotuner."""
    d = _head_dim_class(head_dim)
    if d == 64 and causal and n_bucket <= SHORT_CAUSAL_N:
        return SHORT_CAUSAL_64
    return HOPPER_TABLE[d]


def lse_rounding(dtype: torch.dtype, head_dim: int) -> float:
    """The largest error of this kernel's lse that comes from summing P after rounding it. With
    ROWSUM_MMA the tensor cores sum P rounded to the inputs' dtype: every term is positive and off
    by at most the unit roundoff u, so l is off by a factor 1 ± u at most and lse = m + ln l by u
    (fp16: 4.9e-4, bf16: 3.9e-3); O is normalised by the very weights that multiplied V. 0 where
    no config of this head dim sums that way, or for fp32 inputs."""
    if dtype == torch.float32 or not HOPPER_TABLE[_head_dim_class(head_dim)].kwargs["ROWSUM_MMA"]:
        return 0.0
    return torch.finfo(dtype).eps / 2


def tma_compatible(t: torch.Tensor) -> bool:
    """TMA's rules: last dim contiguous, other strides and the base 16-byte aligned."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * es) % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [1, 1, rows, t.shape[-1]])


def _descriptors(q, k, v, o) -> tuple:
    """The TMA descriptors of q, k, v and o, and ``prepare(blocks)`` for ``launch``, which sets
    their tile shapes to a config's (``_set_block_shapes``)."""
    descs = [_descriptor(t, 16) for t in (q, k, v, o)]
    named = dict(zip(("desc_q", "desc_k", "desc_v", "desc_o"), descs), HEAD_DIM=q.shape[-1])
    return descs, lambda blocks: _set_block_shapes({**named, **blocks})


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if TMA can read it, else a fresh (aligned, contiguous) copy: a view that
    ``t.contiguous()`` returns as it is may start at a misaligned address."""
    if tma_compatible(t):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def forward_hopper(q, k, v, causal, sm_scale, out=None, store_lse=True, bind=False):
    """``flash_v2.forward_portable`` with the TMA kernel: the same arguments and results (with
    ``bind``, the four TMA descriptors move to the new addresses). Power-of-two head dims only: a
    TMA tile spans the whole head dim, and ``best_impl`` sends any other to the portable kernel."""
    B, H, N_Q, D = q.shape
    if D & (D - 1):
        raise ValueError(f"the Hopper kernel (impl='hopper') takes power-of-two head dims only, "
                         f"got head dim {D} of q; use impl='portable' (or None)")
    H_KV, N_K = k.shape[1], k.shape[2]
    given = (q, k, v)
    q, k, v = (tma_ready(t) for t in given)
    o, lse = allocate_outputs(q, out, store_lse)
    lse_arg = o if lse is None else lse  # (never written without store_lse)
    descs, prepare = _descriptors(q, k, v, o)
    args = (*descs, lse_arg, sm_scale * LOG2E.value, 1.0, H, H // H_KV, N_Q, N_K,  # 1.0: one
            next_pow2(max(N_Q, N_K)))
    meta = {"HEAD_DIM": D, "CAUSAL": bool(causal), "DOT_PRECISION": dot_precision(q.dtype),
            "STORE_LSE": bool(store_lse)}
    bindable = (bind and all(a is b for a, b in zip((q, k, v), given))
                and aligned(q, k, v, o, lse_arg))
    again = launch(_flash_fwd_v2_hopper_kernel, lambda bm: (cdiv(N_Q, bm), B * H), args, meta,
                   hopper_config(D, causal, args[-1]), prepare=prepare, free=5 if bindable else 0)
    return (o, lse, again) if bind else (o, lse)
