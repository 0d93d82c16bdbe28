"""Flash-Decoding's last step: the splits' partial results merged into one answer per query row.

notebooks/12_flash_decoding.ipynb (the merge kernel and the fused merge; lesson 01's (m, d)
merge of two partial softmaxes, in the log domain). The split kernel (``decode.py``) leaves, for
each query row and split ``s``, the normalised ``o_s`` (fp32) and the natural-log ``lse_s`` of
the keys it saw (−inf for a split that saw none). Then

    lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s

in two passes over the row's splits: the largest ``lse_s`` first (every exponential then ≤ 1),
then the weighted sum, ``CHUNK`` splits at a time. With an attention sink (GPT-OSS, lesson 15:
``HAS_SINK``) the sink's logit is one more term of the sum with no value, ``lse = log(e^sink +
Σ_s e^{lse_s})``; a row that no split saw gets o = 0 and ``lse = sink``.

``_merge_rows`` merges ``ROWS`` rows side by side (their loads go out together), run by
``_decode_merge_kernel`` or by the split kernel itself (``FUSED_MERGE``: the last split of a
group of rows), with the same chunking, so the two merges give the same sums.

Speed: not benchmarked on its own. On an NVIDIA H200, the rows side by side took a B 1, N 4k
``flash_decode`` step from 18.2–18.6 to 14.5–15.0 µs (data/decode_merge.json; perf_notes.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib.kernels.attention_common import _tile_mask


@triton.jit
def _merge_rows(O_PART, LSE_PART, rows, rows_ok, out_ptrs, LSE_OUT, sinks, ROWS: tl.constexpr,
                NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHUNK: tl.constexpr, HAS_SINK: tl.constexpr = False):
    """Merge the NUM_SPLITS partial results of the ROWS query rows ``rows`` (those with
    ``rows_ok``) into ``out_ptrs`` (ROWS, HEAD_DIM_PAD) and ``LSE_OUT[rows]``; ``sinks``: the
    rows' sink logits (natural log), with HAS_SINK. The rows are merged side by side: their
    loads go out together."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # columns past D masked
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # pass 1: each row's largest lse_s (empty splits hold -inf), and its sink's logit
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + rows[:, None] * NUM_SPLITS + offs_s[None, :],
                      mask=rows_ok[:, None] & (offs_s[None, :] < NUM_SPLITS),
                      other=float("-inf"))  # (ROWS, BLOCK_S)
    lse_max = tl.max(lse_all, 1)
    if HAS_SINK:
        lse_max = tl.maximum(lse_max, sinks)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    # pass 2: o = Σ_s e^{lse_s − lse_max} o_s / Σ_s e^{lse_s − lse_max}, CHUNK splits at a time
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    denom = tl.zeros([ROWS, CHUNK], tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        part = rows[:, None] * NUM_SPLITS + offs_c[None, :]  # (ROWS, CHUNK): row, split
        c_ok = rows_ok[:, None] & (offs_c[None, :] < NUM_SPLITS)
        lse_s = tl.load(LSE_PART + part, mask=c_ok, other=float("-inf"))
        used = lse_s > float("-inf")
        w = tl.where(used, tl.exp(lse_s - lse_max[:, None]), 0.0)
        o_mask = _tile_mask(c_ok[:, :, None], offs_d[None, None, :] < HEAD_DIM, PAD_D)
        o_s = tl.load(O_PART + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=o_mask, other=0.0)  # (ROWS, CHUNK, HEAD_DIM_PAD), with the lses
        o_s = tl.where(used[:, :, None], o_s, 0.0)  # an empty split adds nothing, NaN or not
        acc += tl.sum(o_s * w[:, :, None], 1)
        denom += w
    total = tl.sum(denom, 1)
    if HAS_SINK:  # one more term of the denominator, e^{sink}, with no value
        total += tl.exp(sinks - lse_max)
    total_safe = tl.where(total > 0.0, total, 1.0)
    o = acc / total_safe[:, None]  # (ROWS, HEAD_DIM_PAD)
    lse = tl.where(total > 0.0, lse_max + tl.log(total_safe), float("-inf"))
    o_ok = _tile_mask(rows_ok[:, None], offs_d[None, :] < HEAD_DIM, PAD_D)
    tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=o_ok)
    tl.store(LSE_OUT + rows, lse, mask=rows_ok)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, OUT, LSE_OUT, SINKS,  # SINKS (H,) fp32, read only with HAS_SINK
    H, ROWS_TOTAL,
    stride_ob, stride_oh, stride_om,
    N_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr = 16, ROWS: tl.constexpr = 1,
    HAS_SINK: tl.constexpr = False,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (b·H + h)·N_Q + i
    rows_ok = rows < ROWS_TOTAL
    bh, i = rows // N_Q, rows % N_Q
    b, h = bh // H, tl.where(rows_ok, bh % H, 0)
    sinks = 0.0
    if HAS_SINK:
        sinks = tl.load(SINKS + h).to(tl.float32)
    offs_d = tl.arange(0, triton.next_power_of_2(HEAD_DIM))
    out_ptrs = (OUT + b.to(tl.int64)[:, None] * stride_ob + h[:, None] * stride_oh
                + i[:, None] * stride_om + offs_d[None, :])
    _merge_rows(O_PART, LSE_PART, rows, rows_ok, out_ptrs, LSE_OUT, sinks, ROWS, NUM_SPLITS,
                BLOCK_S, HEAD_DIM, CHUNK, HAS_SINK)
