"""FlashAttention-2 forward, portable: one Triton kernel for every GPU and for the interpreter.

Introduced in notebooks/08_triton_flash_v2.ipynb. Called through ``course_lib.ops.flash_attn_v2``
(validation, the choice of kernel, autograd); this file holds the kernel and its launcher
``forward_portable``. The Hopper version is ``flash_v2_hopper.py``, the backward ``flash_bwd.py``;
what the three share is ``attention_common.py``.

What it computes. O = softmax(sm_scale · QKᵀ)·V, optionally causal (bottom-right aligned: query i
sees keys j <= i + N_k − N_q), and the natural-log log-sum-exp of every row. q (B, H, N_q, D);
k, v (B, H_kv, N_k, D) with H_kv dividing H (GQA: query head h reads K/V head h // (H / H_kv)).
A row that sees no key gives O = 0 and lse = −inf.

Grid (⌈N_q / BLOCK_M⌉, B·H): one program per BLOCK_M query rows of one head. It keeps its Q tile,
the running max m, the running sum l and the fp32 accumulator on chip, streams K and V tiles of
BLOCK_N keys (pointer arithmetic, any stride), and writes O and the lse (``STORE_LSE``: the
backward needs it, inference does not) once. Key blocks every row sees run with no mask, then
the diagonal band and the ragged end masked (``_fwd_inner``); blocks above the diagonal are
never loaded. Per score: one exp2 (``qk_scale = sm_scale · log2 e``); one division at the end.

Head dims: every multiple of 8 from 16 to 256. ``tl.arange`` needs a power of two, so the tiles
span D rounded up (80 -> 128); the columns past D load as 0 and are never stored.

Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22 (fp16, B·N = 32k,
H·D = 2048; every provider called eagerly, ``do_bench`` median of 5 interleaved rounds; FLOPs
4·B·H·N²·D; course_lib/data/attention_fwd.json):

* D 128, N 16k, non-causal: 476 TFLOP/s, 1.37x SDPA FLASH_ATTENTION, 0.81x SDPA CUDNN_ATTENTION
* D 64, N 16k, non-causal: 414 TFLOP/s, 1.32x SDPA FLASH_ATTENTION, 0.94x SDPA CUDNN_ATTENTION

On sm_90 ``flash_attn_v2`` runs the Hopper kernel instead. How the numbers came about:
course_lib/data/perf_notes.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib.kernels.attention_common import (  # noqa: F401 (the lesson reads them here)
    AUTOTUNE_MIN_N,
    INTERPRETER_BLOCKS,
    LOG2E,
    _causal_bounds,
    _epilogue,
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

LOG2E = LOG2E.value  # log2(e) as a float, for host code (notebook 08 reads it here)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_ok,
               lo, hi, N_K, q_offset, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr, PAD_D: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM_PAD)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM_PAD)
        if MASKED:  # the ragged end of the keys
            kv_ok = offs_n[:, None] < N_K
            if PAD_D:
                kv_ok = kv_ok & d_ok
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        elif PAD_D:  # whole key blocks: only the padding columns of the head dim are masked
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        valid = offs_n[None, :] < N_K
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + q_offset)
        p, m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, valid, qk_scale, MASKED)
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        elif PAD_D:
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_v2_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    qk_scale, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr = True,
):
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, CAUSAL)
    start_m = pid_m * BLOCK_M
    # tl.arange needs a power of two: a head dim like 80 runs as 128 columns, the last 48 masked
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d[None, :] < HEAD_DIM
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    m_ok = offs_m[:, None] < N_Q
    if PAD_D:
        m_ok = m_ok & d_ok  # the columns past HEAD_DIM: loaded as 0, never stored
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok,
                other=0.0)  # (BLOCK_M, HEAD_DIM_PAD), stays on chip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    lo_masked, hi = _causal_bounds(start_m, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    q_offset = N_K - N_Q
    # stage 1: key blocks every row sees in full (no mask at all)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, d_ok, 0, lo_masked, N_K, q_offset, qk_scale,
                               BLOCK_N, False, CAUSAL, DOT_PRECISION, PAD_D)
    # stage 2: the diagonal band and the ragged end of the keys (masked)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, d_ok, lo_masked, hi, N_K, q_offset, qk_scale,
                               BLOCK_N, True, CAUSAL, DOT_PRECISION, PAD_D)

    o, lse = _epilogue(acc, m_i, l_i)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=m_ok)
    if STORE_LSE:  # the backward needs it; inference does not
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# Configs. On a GPU, from AUTOTUNE_MIN_N keys on, the autotuner times the candidates that fit
# the head dim; shorter sequences run the first that fits, the interpreter INTERPRETER_BLOCKS.
def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


PORTABLE_CONFIGS = [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 3)]


def keep_config_for_head_dim(configs, named_args, **kwargs):
    """Config filter (the autotuner's ``early_config_prune``, and ``forward_portable``'s): the
    candidates whose shared memory fits the (padded: 80 -> 128) head dim. HEAD_DIM 256 passes
    only 64 x 64 tiles (a 128 x 256 Q tile plus K/V stages overflows the 228 KB of an H100 SM);
    HEAD_DIM 128 drops 128 x 128 with 3 stages for the same reason."""
    d = next_pow2(named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"])
    kept = [c for c in configs
            if not (d >= 256 and (c.kwargs["BLOCK_M"] > 64 or c.kwargs["BLOCK_N"] > 64))
            and not (d == 128 and c.kwargs["BLOCK_N"] > 64 and c.num_stages > 2)]
    return kept or configs[-1:]


_portable_tuned = triton.autotune(
    configs=PORTABLE_CONFIGS,
    key=["N_BUCKET", "HEAD_DIM", "CAUSAL", "DOT_PRECISION", "GROUP"],
    prune_configs_by={"early_config_prune": keep_config_for_head_dim},
)(_flash_fwd_v2_kernel)


def forward_portable(q, k, v, causal, sm_scale, out=None, store_lse=True, bind=False):
    """(o, lse) of validated inputs (``out``: preallocated; ``store_lse=False``: lse is None).
    ``bind``: also return ``again(q, k, v, o, lse)``, this launch for new tensors of the same
    shapes, strides, dtype and device, 16-byte aligned (``course_lib._launch.bind``), or None
    (the interpreter; an input copied here; a misaligned address)."""
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    given = (q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in given)
    o, lse = allocate_outputs(q, out, store_lse)
    lse_arg = o if lse is None else lse  # (never written without store_lse)
    args = (q, k, v, o, lse_arg, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], sm_scale * LOG2E, H, H // H_KV, N_Q, N_K, next_pow2(max(N_Q, N_K)))
    meta = {"HEAD_DIM": D, "CAUSAL": bool(causal), "DOT_PRECISION": dot_precision(q.dtype),
            "STORE_LSE": bool(store_lse)}
    bindable = (bind and all(a is b for a, b in zip((q, k, v), given))
                and aligned(q, k, v, o, lse_arg))
    config = keep_config_for_head_dim(PORTABLE_CONFIGS, {"HEAD_DIM": D})[0]
    again = launch(_flash_fwd_v2_kernel, lambda bm: (cdiv(N_Q, bm), B * H), args, meta, config,
                   _portable_tuned if args[-1] >= AUTOTUNE_MIN_N else None,
                   free=5 if bindable else 0)
    return (o, lse, again) if bind else (o, lse)
