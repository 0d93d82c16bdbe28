"""FlashAttention-2 forward for Hopper (sm_90) with the variants of open models: sliding window,
softcap, ALiBi, sinks.

For notebooks/15_attention_variants.ipynb. ``course_lib.ops.flash_attn_v2`` with any of
``window_size``, ``softcap``, ``alibi_slopes``, ``sinks`` runs it on sm_90 where lesson 09's
Hopper kernel would run (``course_lib.ops.impl.best_impl``); elsewhere the portable variants'
kernel (``flash_variants.py``) runs. It computes exactly what that kernel computes (the same
``band.py`` rules, the same scores, a row that sees no key gets O = 0 and lse = −inf, or the
sink's logit with a sink), with the memory plan of lesson 09's kernel (``flash_v2_hopper.py``):

1. TMA descriptors for Q, K, V and O, (B, H, N, D); tiles past the ends are clipped (zeros in,
   nothing out). Packed sequences (varlen) stay on the portable kernel.
2. Software pipelining of the K/V tiles, Q in registers, row sums on the tensor cores
   (``ROWSUM_MMA``), as lesson 09's kernel.
3. **The pinned max, with the band.** The dense kernel pins each row's max after the first key
   block, which every row of a causal block sees. In a band the first block may hold no key of
   some rows, so this kernel first runs the *last block every row sees in full* (the one
   nearest the diagonal), pins its row max, and then runs the rest of the band against it in
   any order: with no running max there is no rescaling, so the order of the blocks does not
   matter. A block with no such full key block (a window narrower than the tile), or a weight
   2^(s − m) that overflows P (above fp16's 65504, about 2^16), runs again with the running
   max. ALiBi keeps the running max: its bias lets a row's nearest keys score up to
   slope × (BLOCK_M + BLOCK_N − 1) above the pinned block (63.5 at slope 1/2 with 64 × 64 tiles),
   enough to overflow fp16's P and run the program twice; pinning for gentle slopes is not
   measured.

Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-27 (B 2, H 16, N 16k,
D 128, bf16; every provider called eagerly, ``do_bench`` median of 7 rounds in turns; TFLOP/s on
the visited area, 4·B·H·D per (query, key) pair a row sees; ``python -m course_lib.bench
variants``, course_lib/data/variants_fwd.json): causal 529 TFLOP/s (FlexAttention 426); window
1024: 403 (FlexAttention 310), 6.29x faster than its own full causal and 6.03x faster than the
dense Hopper kernel's; causal with softcap 473 (FlexAttention 204), with ALiBi 445 (FlexAttention
393), with sinks 534; the dense flash_attn_v2 causal 552 (Hopper kernel). The tiles, pinned max
and row sums were chosen by timing every candidate in turns (``--tiles``,
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
    allocate_outputs,
    cdiv,
    dot_precision,
    launch,
    next_pow2,
)
from course_lib.kernels.band import (
    GPU_TANH,
    _band_bounds,
    _join_sink,
    _key_limits,
    _variant_scores,
)
from course_lib.kernels.flash_v2_hopper import _descriptor, _set_block_shapes, tma_ready
from course_lib.validate import Variant


@triton.jit
def _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo, hi, q_offset, sm_scale,
              softcap, slope, j_lo, j_hi, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, PINNED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWSUM_MMA: tl.constexpr):
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
        s = _variant_scores(qk, offs_m, offs_n, q_offset, sm_scale, softcap, slope, HAS_SOFTCAP,
                            HAS_ALIBI, GPU_TANH and DOT_PRECISION != "ieee")
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
    desc_q, desc_k, desc_v, desc_o, LSE, ALIBI, SINKS,
    stride_alibi_b, sm_scale, softcap, one, LEFT, RIGHT, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_IN_REGS: tl.constexpr = True,
    ROWSUM_MMA: tl.constexpr = False, PINNED_MAX: tl.constexpr = False,
    STORE_LSE: tl.constexpr = True,
):
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, LONGEST_FIRST)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past N_Q are zeros
    if Q_IN_REGS:  # (lesson 09: a computed q lives in registers, wgmma's "RS" form)
        q = (q * one).to(desc_q.dtype)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b.to(tl.int64) * stride_alibi_b + h).to(tl.float32)
    q_offset = N_K - N_Q
    lo, full_lo, full_hi, hi = _band_bounds(start_m, N_Q, N_K, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    j_lo, j_hi = _key_limits(offs_m + q_offset, N_K, LEFT, RIGHT)
    acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)
    PIN: tl.constexpr = PINNED_MAX and not HAS_ALIBI
    redo = full_hi <= full_lo  # no key block that every row sees in full: the running max
    if PIN:
        if full_hi > full_lo:
            pin = full_hi - BLOCK_N  # the full block nearest the diagonal sets the reference
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, pin,
                                      full_hi, q_offset, sm_scale, softcap, slope, j_lo, j_hi,
                                      HEAD_DIM, BLOCK_N, False, False, HAS_SOFTCAP, HAS_ALIBI,
                                      DOT_PRECISION, ROWSUM_MMA)
            # the rest of the band against it, in any order (nothing is rescaled)
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo,
                                      full_lo, q_offset, sm_scale, softcap, slope, j_lo, j_hi,
                                      HEAD_DIM, BLOCK_N, True, True, HAS_SOFTCAP, HAS_ALIBI,
                                      DOT_PRECISION, ROWSUM_MMA)
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                      full_lo, pin, q_offset, sm_scale, softcap, slope, j_lo,
                                      j_hi, HEAD_DIM, BLOCK_N, False, True, HAS_SOFTCAP,
                                      HAS_ALIBI, DOT_PRECISION, ROWSUM_MMA)
            acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m,
                                      full_hi, hi, q_offset, sm_scale, softcap, slope, j_lo,
                                      j_hi, HEAD_DIM, BLOCK_N, True, True, HAS_SOFTCAP,
                                      HAS_ALIBI, DOT_PRECISION, ROWSUM_MMA)
            # a weight 2^(s − m) above fp16's 65504 made P overflow (inf): again, with the
            # running max (NaN fails the test too)
            redo = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0
    else:
        redo = True
    if redo:
        acc, m_i, l_i = _fresh_state(BLOCK_M, HEAD_DIM, ROWSUM_MMA)
        # the band's left edge (masked), the blocks every row sees (no mask), the right edge
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, lo, full_lo,
                                  q_offset, sm_scale, softcap, slope, j_lo, j_hi, HEAD_DIM,
                                  BLOCK_N, True, False, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                  ROWSUM_MMA)
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, full_lo,
                                  full_hi, q_offset, sm_scale, softcap, slope, j_lo, j_hi,
                                  HEAD_DIM, BLOCK_N, False, False, HAS_SOFTCAP, HAS_ALIBI,
                                  DOT_PRECISION, ROWSUM_MMA)
        acc, m_i, l_i = _band_tma(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, offs_m, full_hi, hi,
                                  q_offset, sm_scale, softcap, slope, j_lo, j_hi, HEAD_DIM,
                                  BLOCK_N, True, False, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                  ROWSUM_MMA)
    if ROWSUM_MMA:
        l_i = tl.max(l_i, 1)  # every column holds the same sums
    if HAS_SINKS:  # one more term of the denominator, e^{sink}, with no value
        acc, m_i, l_i = _join_sink(acc, m_i, l_i, tl.load(SINKS + h).to(tl.float32))
    o, lse = _epilogue(acc, m_i, l_i)
    desc_o.store([b, h, start_m, 0], o.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    if STORE_LSE:
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


def _cfg(bm, bn, warps, stages, rowsum_mma=False, pinned_max=True):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "Q_IN_REGS": True,
                          "ROWSUM_MMA": rowsum_mma, "PINNED_MAX": pinned_max},
                         num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes)


# The candidates, as (BLOCK_M, BLOCK_N, warps, stages, ROWSUM_MMA, PINNED_MAX) in ``_KEEP``, which
# names the one each head dim runs, chosen by timing every candidate in turns (``python -m
# course_lib.bench variants --tiles``, course_lib/data/variants_hopper_tiles.json).
VARIANTS_HOPPER_CONFIGS = [
    _cfg(64, 64, 4, 3, True), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3),
    _cfg(64, 64, 4, 3, True, False), _cfg(128, 128, 8, 2), _cfg(64, 64, 4, 2),
]
# D 128 (B 2, H 16, N 16k, bf16, H100): 64 x 64 tiles, pinned max, row sums on the CUDA cores:
# causal 504 TFLOP/s, window 1024 382, softcap 506, ALiBi 436, sinks 511 (the other candidates'
# numbers: course_lib/data/perf_notes.md). D 64 and 256 use lesson 09's dense tiles, with the
# row sums on the CUDA cores: not measured with the variants, so ``impl=None`` sends them to the
# portable kernel (``MEASURED_HEAD_DIMS``).
_KEEP = {64: [(128, 64, 4, 3, False, True)], 128: [(64, 64, 4, 3, False, True)],
         256: [(64, 64, 4, 2, False, True)]}
MEASURED_HEAD_DIMS = (128,)


def _shape(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
            c.kwargs["ROWSUM_MMA"], c.kwargs["PINNED_MAX"])


def keep_variants_hopper_config(configs, named_args, **kwargs):
    """Config filter: the config ``_KEEP`` names for this head dim among ``configs`` (the last if
    none); no autotuner, the table names one config per head dim."""
    d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
    wanted = _KEEP[64 if d <= 64 else 128 if d <= 128 else 256]
    kept = [c for c in configs if _shape(c) in wanted]
    return kept or configs[-1:]


def forward_variants_hopper(q, k, v, sm_scale: float, variant: Variant, out=None,
                            store_lse=True, config: triton.Config | None = None):
    """``flash_variants.forward_variants`` with the TMA kernel: the same arguments and
    results. Power-of-two head dims from 16 on (a TMA tile spans the whole head dim).
    ``config``: one of ``VARIANTS_HOPPER_CONFIGS`` to run instead of ``_KEEP``'s (the tile
    benchmark, ``python -m course_lib.bench variants --tiles``; a GPU only)."""
    B, H, N_Q, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Hopper kernel takes power-of-two head dims of 16 or more, got "
                         f"head dim {D} of q; the portable kernel pads any other")
    H_KV, N_K = k.shape[1], k.shape[2]
    window, softcap, alibi_slopes, sinks = variant
    q, k, v = (tma_ready(t) for t in (q, k, v))
    o, lse = allocate_outputs(q, out, store_lse)
    lse_arg = o if lse is None else lse  # (never written without store_lse)
    descs = [_descriptor(t, 16) for t in (q, k, v, o)]  # block shapes: set by the config
    named = dict(zip(("desc_q", "desc_k", "desc_v", "desc_o"), descs), HEAD_DIM=D)
    alibi_b = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.ndim == 2 else 0
    args = (*descs, lse_arg, alibi_slopes if alibi_slopes is not None else lse_arg,
            sinks if sinks is not None else lse_arg, alibi_b, float(sm_scale),
            float(softcap) or 1.0, 1.0, int(window[0]), int(window[1]), H, H // H_KV, N_Q, N_K,
            next_pow2(max(N_Q, N_K)))
    meta = {"HEAD_DIM": D, "LONGEST_FIRST": tuple(window) == (-1, 0),
            "HAS_SOFTCAP": softcap > 0, "HAS_ALIBI": alibi_slopes is not None,
            "HAS_SINKS": sinks is not None, "DOT_PRECISION": dot_precision(q.dtype),
            "STORE_LSE": lse is not None}
    if config is not None:
        blocks = dict(config.kwargs)
        _set_block_shapes({**named, **blocks})
        _flash_fwd_variants_hopper_kernel[(cdiv(N_Q, blocks["BLOCK_M"]), B * H)](
            *args, **meta, **blocks, num_warps=config.num_warps, num_stages=config.num_stages)
        return o, lse
    config = keep_variants_hopper_config(VARIANTS_HOPPER_CONFIGS, {"HEAD_DIM": D})[0]
    launch(_flash_fwd_variants_hopper_kernel, lambda bm: (cdiv(N_Q, bm), B * H), args, meta,
           config, prepare=lambda blocks: _set_block_shapes({**named, **blocks}))
    return o, lse


__all__ = ["MEASURED_HEAD_DIMS", "VARIANTS_HOPPER_CONFIGS", "forward_variants_hopper"]
