"""FlashAttention-2 forward for the attention of open models: sliding window, softcap, ALiBi, sinks.

For notebooks/15_attention_variants.ipynb: ``course_lib.ops.flash_attn_v2``'s keywords
``window_size``, ``softcap``, ``alibi_slopes``, ``sinks`` and ``flash_attn_varlen`` run it (the
backward is ``flash_variants_bwd.py``, the decode ``decode.py``). It is lesson 08's portable
kernel (``flash_v2.py``) with two changes, which is the lesson's point: every variant is

1. **a rule for which key blocks a block of query rows visits** (``_band_bounds``, in ``band.py``,
   the jit twin of ``course_lib.masks.block_key_range``): keys a block's rows never see are never
   loaded, keys every row sees run with no mask, and the rest run masked. The window ``(left,
   right)`` is FlashAttention's, bottom-right aligned (query i at key position p = i + N_k − N_q
   sees p − left <= j <= p + right, −1 unbounded); causal is ``right = 0``.
2. **a change to the scores** (``_variant_scores``). With ``s = sm_scale·q·k``: softcap
   ``s = c·tanh(s / c)`` (Gemma 2), then ALiBi ``s −= slope·|p − j|``; and after the loop, the
   sink (GPT-OSS): one more logit per head in the softmax's denominator, with no value, so
   ``o = Σ e^s v / (e^sink + Σ e^s)`` and the lse includes it.

Packed sequences (``forward_variants_varlen``, FlashAttention's varlen layout: q (total_q, H,
D), ``cu_seqlens``) run in the same kernel (``VARLEN``): a program reads its sequence's offsets
and lengths. With a block table (``PAGE_SIZE`` > 0) K and V are lesson 13's pages, and key n of
sequence b is row ``table[b, n // PAGE_SIZE]·PAGE_SIZE + n % PAGE_SIZE`` of them (``_key_rows``):
a serving step's prefill chunks and decode tokens in one launch (lesson 16); with ``KV_SCALED``
the pages are 8-bit (int8 or e4m3, ``course_lib.kvquant``) and each key's scale acts outside the
two products, as in the decode. A row that sees no key: O = 0 and lse = −inf (the sink's logit
with a sink).
``course_lib.reference.attention_variants`` is the ground truth.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (B 2, H 16, N 16k, D 128, bf16;
every provider called eagerly, ``do_bench`` median of 7 rounds in turns; TFLOP/s on the visited
area, 4·B·H·D per (query, key) pair a row sees; ``python -m course_lib.bench variants``,
course_lib/data/variants_fwd.json): causal 496 TFLOP/s (FlexAttention 419); window 1024: 328
(FlexAttention 314), 5.44x faster than full causal; causal with softcap 420, with ALiBi 443, with
sinks 486; the dense flash_attn_v2 causal 475 (portable kernel) and 539 (Hopper kernel). On Hopper
(sm_90: H100, H200) at D 128, ``flash_attn_v2`` runs the TMA variants kernel instead
(``flash_variants_hopper.py``); packed sequences always run this one. The story, and what is not
measured yet: course_lib/data/perf_notes.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.kernels.attention_common import (
    AUTOTUNE_MIN_N,
    LOG2E,
    _epilogue,
    _load_tile,
    _online_softmax_step,
    _q_block_program,
    aligned,
    allocate_outputs,
    cdiv,
    dot_precision,
    launch,
    next_pow2,
)
from course_lib.kernels.band import (  # noqa: F401 (re-exported: lesson 15 prints them)
    GPU_TANH,
    _band_bounds,
    _head_values,
    _join_sink,
    _key_limits,
    _sequence,
    _tanh,
    _variant_scores,
    variant_args,
)
from course_lib.kernels.flash_v2 import PORTABLE_CONFIGS, _cfg, keep_config_for_head_dim
from course_lib.masks import Variant


@triton.jit
def _key_rows(offs_n, table, N_K, PAGE_SIZE: tl.constexpr):
    """Where keys ``offs_n`` of a sequence lie, in rows of K and V: the keys themselves, or in
    a paged cache (PAGE_SIZE > 0) row ``table[n // PAGE_SIZE]·PAGE_SIZE + n % PAGE_SIZE`` of
    the pages (PagedAttention's layout). ``table``: (the sequence's row of the block table,
    the pages, the row's length). Keys past N_K read entry 0 (masked); an entry or a block id
    out of range is clamped into the table and the pool: a wrong answer, never a read outside
    them (the decode's rule)."""
    if PAGE_SIZE > 0:
        row, num_pages, max_blocks = table[0], table[1], table[2]
        entry = tl.minimum(offs_n // PAGE_SIZE, max_blocks - 1)
        page = tl.load(row + entry, mask=offs_n < N_K, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        return page * PAGE_SIZE + offs_n % PAGE_SIZE
    else:
        return offs_n


@triton.jit
def _variants_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_ok,
                    lo, hi, N_K, q_offset, sm_scale, VARIANT, head_values, j_lo, j_hi, table,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    PAD_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    KV_SCALED: tl.constexpr = False):
    """With KV_SCALED, K and V are 8-bit pages and ``table[3:]`` = (this head's k scales, its v
    scales, their row stride): the tiles become q's dtype (exact) and each key's scale acts
    outside the products, as in the decode (``course_lib.kvquant``)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        rows = _key_rows(offs_n, table, N_K, PAGE_SIZE)
        k_ptrs = k_base + rows[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM_PAD)
        v_ptrs = v_base + rows[:, None] * stride_vn + offs_d[None, :]
        rows_ok = offs_n[:, None] < N_K
        k = _load_tile(k_ptrs, rows_ok, d_ok, MASKED, PAD_D)  # no mask where the band is full
        if KV_SCALED:
            k_scale = tl.load(table[3] + rows * table[5], mask=offs_n < N_K, other=0.0)
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if KV_SCALED:
            qk = qk * k_scale[None, :]  # q · (k̂ · k_scale), per key
        s = _variant_scores(qk, offs_m + q_offset, offs_n, sm_scale, VARIANT, head_values,
                           GPU_TANH and DOT_PRECISION != "ieee")[0]
        # the band (masked tiles only): p − left <= j <= p + right and j < N_K
        valid = (offs_n[None, :] >= j_lo[:, None]) & (offs_n[None, :] <= j_hi[:, None])
        p_tile, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, valid,
                                                     sm_scale * LOG2E, MASKED)
        v = _load_tile(v_ptrs, rows_ok, d_ok, MASKED, PAD_D)
        if KV_SCALED:
            v_scale = tl.load(table[4] + rows * table[5], mask=offs_n < N_K, other=0.0)
            p_tile = p_tile * v_scale[None, :]  # the scale rides on P's column
            v = v.to(q.dtype)
        acc = tl.dot(p_tile.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_variants_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, TABLE, SCALES,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_lse_b, stride_lse_h,
    VARIANT, sm_scale, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, VARIANT_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STORE_LSE: tl.constexpr = True, VARLEN: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 0,
    KV_SCALED: tl.constexpr = False,
):
    """``VARIANT``: the call's variants (``band.variant_args``); ``VARIANT_KIND`` which of them
    it has, for the autotuner's key. PAGE_SIZE > 0: K and V are pages, and TABLE = (the block
    table (B, max_blocks), its row stride, the pages, max_blocks) maps sequence b's key blocks
    to them; with KV_SCALED the pages are 8-bit and SCALES = (k_scale, v_scale, their row and
    head strides), one fp32 scale per token and head laid out as the pages without D."""
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, LONGEST_FIRST)
    start_m = pid_m * BLOCK_M
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d[None, :] < HEAD_DIM
    q_start, k_start, N_Q, N_K = _sequence(CU_Q, CU_K, b, N_Q, N_K, VARLEN)  # (packed: its rows)
    table_ptr, stride_tb, num_pages, max_blocks = TABLE
    k_scales, v_scales, stride_sn, stride_sh = SCALES
    table = (table_ptr + b.to(tl.int64) * stride_tb, num_pages, max_blocks,  # (paged: its row)
             k_scales + h_kv * stride_sh, v_scales + h_kv * stride_sh, stride_sn)
    if PAGE_SIZE > 0:
        k_start = 0  # a paged sequence's keys are found through its table
    q_base = Q + b.to(tl.int64) * stride_qb + q_start * stride_qm + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + k_start * stride_kn + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + k_start * stride_vn + h_kv.to(tl.int64) * stride_vh
    m_ok = offs_m[:, None] < N_Q
    if PAD_D:
        m_ok = m_ok & d_ok
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok, other=0.0)
    head_values = _head_values(VARIANT, b, h)  # (ALiBi's slope)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    q_offset = N_K - N_Q
    lo, full_lo, full_hi, hi = _band_bounds(start_m, N_Q, N_K, VARIANT, BLOCK_M, BLOCK_N)
    j_lo, j_hi = _key_limits(offs_m + q_offset, N_K, VARIANT)
    if VARLEN:  # a block past its sequence's end (the grid covers the longest): nothing to do
        past = start_m >= N_Q
        full_lo = tl.where(past, lo, full_lo)
        full_hi = tl.where(past, lo, full_hi)
        hi = tl.where(past, lo, hi)
    # the band's left edge (masked), the blocks every row sees (no mask), the right edge (masked)
    acc, m_i, l_i = _variants_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, d_ok, lo, full_lo, N_K, q_offset, sm_scale,
                                    VARIANT, head_values, j_lo, j_hi, table, BLOCK_N, True,
                                    DOT_PRECISION, PAD_D, PAGE_SIZE, KV_SCALED)
    acc, m_i, l_i = _variants_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, d_ok, full_lo, full_hi, N_K, q_offset,
                                    sm_scale, VARIANT, head_values, j_lo, j_hi, table, BLOCK_N,
                                    False, DOT_PRECISION, PAD_D, PAGE_SIZE, KV_SCALED)
    acc, m_i, l_i = _variants_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                    offs_m, offs_d, d_ok, full_hi, hi, N_K, q_offset, sm_scale,
                                    VARIANT, head_values, j_lo, j_hi, table, BLOCK_N, True,
                                    DOT_PRECISION, PAD_D, PAGE_SIZE, KV_SCALED)
    # with sinks: one more term of the denominator, e^{sink}, with no value
    acc, m_i, l_i = _join_sink(acc, m_i, l_i, VARIANT, h)

    o, lse = _epilogue(acc, m_i, l_i)
    o_base = O + b.to(tl.int64) * stride_ob + q_start * stride_om + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=m_ok)
    if STORE_LSE:
        lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_start
        tl.store(lse_base + offs_m, lse, mask=offs_m < N_Q)


# 128 x 64 with 8 warps first (the config of sequences too short to autotune: the fastest fixed
# config, causal and window 1024, at B 2, H 16, N 16k, D 128, bf16 on an H100; perf_notes.md),
# then the portable kernel's tiles.
VARIANT_CONFIGS = [_cfg(128, 64, 8, 3), *PORTABLE_CONFIGS]

_variants_tuned = triton.autotune(
    configs=VARIANT_CONFIGS,
    key=["N_BUCKET", "HEAD_DIM", "LONGEST_FIRST", "VARIANT_KIND", "DOT_PRECISION", "GROUP",
         "PAGE_SIZE", "KV_SCALED"],
    prune_configs_by={"early_config_prune": keep_config_for_head_dim},
)(_flash_fwd_variants_kernel)


def _launch(q, k, v, o, lse, sm_scale, variant, B, N_Q, N_K, strides, cu=None, table=None,
            free=0, scales=None):
    """One launch on B sequences (at most N_Q queries and N_K keys each). ``strides``: q's, k's,
    v's and o's (batch, head, row), then lse's (batch, head); ``cu``: the packed offsets;
    ``table``: the block table of a paged k and v. ``free``: as ``attention_common.launch``'s
    (the bound launch, or None)."""
    # q (B, H, N, D) or packed (total, H, D); k (B, H_kv, N, D), packed, or pages
    H, H_KV, D = q.shape[1], k.shape[-2] if table is not None else k.shape[1], q.shape[-1]
    lse_arg = o if lse is None else lse  # (never written without STORE_LSE)
    values, kind = variant_args(variant)
    args = (q, k, v, o, lse_arg, *(cu or (lse_arg, lse_arg)),
            (table, table.stride(0), k.shape[0], table.shape[1]) if table is not None
            else (lse_arg, 0, 1, 1),
            (*scales, scales[0].stride(1), scales[0].stride(2)) if scales is not None
            else (lse_arg, lse_arg, 0, 0), *strides, values,
            float(sm_scale), H, H // H_KV, N_Q, N_K, next_pow2(max(N_Q, N_K)))
    meta = dict(HEAD_DIM=D, LONGEST_FIRST=tuple(variant.window) == (-1, 0), VARIANT_KIND=kind,
                DOT_PRECISION=dot_precision(q.dtype), STORE_LSE=lse is not None, VARLEN=bool(cu),
                PAGE_SIZE=k.shape[1] if table is not None else 0, KV_SCALED=scales is not None)
    config = keep_config_for_head_dim(VARIANT_CONFIGS, {"HEAD_DIM": D})[0]
    return launch(_flash_fwd_variants_kernel, lambda bm: (cdiv(N_Q, bm), B * H), args, meta,
                  config, _variants_tuned if args[-1] >= AUTOTUNE_MIN_N else None, free=free)


def forward_variants(q, k, v, sm_scale: float, variant: Variant, out=None, store_lse=True,
                     bind=False):
    """(o, lse) of validated inputs: q (B, H, N_q, D); k, v (B, H_kv, N_k, D); ``variant``
    checked (``course_lib.masks.check_variants``: the window normalised, causal included as
    right = 0). ``out``: preallocated (o, lse); lse is None without ``store_lse``. ``bind``:
    also return the launch for new addresses, as ``flash_v2.forward_portable`` does."""
    B, H, N_Q, _ = q.shape
    given = (q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in given)
    o, lse = allocate_outputs(q, out, store_lse)
    strides = [x for t in (q, k, v, o) for x in t.stride()[:3]] + [H * N_Q, N_Q]
    bindable = bind and all(a is b for a, b in zip((q, k, v), given)) and aligned(q, k, v, o)
    again = _launch(q, k, v, o, lse, sm_scale, variant, B, N_Q, k.shape[2], strides,
                    free=5 if bindable else 0)
    return (o, lse, again) if bind else (o, lse)


def forward_variants_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                            max_seqlen_k: int, sm_scale: float, variant: Variant, out=None,
                            block_table=None, kv_scales=None):
    """Packed sequences (FlashAttention's varlen layout): q (total_q, H, D), k and v (total_k,
    H_kv, D), ``cu_seqlens_*`` int32 (B + 1,) on q's device, each sequence aligned bottom-right
    on its own. Returns o (total_q, H, D) and lse (H, total_q). ``out``: preallocated (o, lse).
    ``block_table`` (B, max_blocks) int32: k and v are pages (num_blocks, page_size, H_kv, D),
    each page contiguous, and sequence b's keys are its ``cu_seqlens_k[b + 1] −
    cu_seqlens_k[b]`` first keys through row b of the table (FlashAttention's paged varlen).
    ``kv_scales``: (k_scale, v_scale) of 8-bit pages, fp32 (num_blocks, page_size, H_kv)."""
    total_q, H, _ = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o, lse = out or (torch.empty_like(q), q.new_empty((H, total_q), dtype=torch.float32))
    # no batch stride: sequence b's rows start at cu_seqlens[b] (paged: at its table's pages)
    kv = [x for t in (k, v) for x in (0, t.stride(-2), t.stride(-3))]
    strides = [0, q.stride(1), q.stride(0), *kv, 0, o.stride(1), o.stride(0), 0, lse.stride(0)]
    _launch(q, k, v, o, lse, sm_scale, variant, len(cu_seqlens_q) - 1, int(max_seqlen_q),
            int(max_seqlen_k), strides, (cu_seqlens_q, cu_seqlens_k), block_table,
            scales=kv_scales)
    return o, lse
