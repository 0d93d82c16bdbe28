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

``_decode_merge_kernel`` runs ``_merge_row`` once per query row (the merge of a CUDA-graph step);
the split kernel can run it itself instead (``FUSED_MERGE``: the last split of a group of rows
merges them), with the same chunking, so the two merges give the same sums.

Speed: not benchmarked on its own. Nsight Compute on an NVIDIA H100 80GB HBM3 (B 1, N 128k, H
32, D 128, 16 splits, torch 2.11.0+cu130, triton 3.6.0, 2026-11-27): the merge kernel took
4.7–4.8 µs of a step whose split kernel took 179–180 µs (course_lib/data/perf_notes.md, "The
128k gap closed by the order of the tiles"; the step's speed is in ``decode.py``'s docstring).
"""
from __future__ import annotations

import triton
import triton.language as tl

from course_lib.kernels.attention_common import _tile_mask


@triton.jit
def _merge_row(O_PART, LSE_PART, row, out_ptr, LSE_OUT, sink, NUM_SPLITS: tl.constexpr,
               BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
               HAS_SINK: tl.constexpr = False):
    """Merge the NUM_SPLITS partial results of query row ``row`` into ``out_ptr`` (HEAD_DIM
    values) and ``LSE_OUT[row]``; ``sink``: the row's sink logit (natural log), with HAS_SINK."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # columns past D masked
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # pass 1: the largest lse_s (empty splits hold -inf), and the sink's logit
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS,
                      other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse_all, 0)
    if HAS_SINK:
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    # pass 2: o = Σ_s e^{lse_s − lse_max} o_s / Σ_s e^{lse_s − lse_max}, CHUNK splits at a time
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    denom = tl.zeros([CHUNK], tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        lse_s = tl.load(LSE_PART + row * NUM_SPLITS + offs_c, mask=offs_c < NUM_SPLITS,
                        other=float("-inf"))  # (CHUNK,)
        used = lse_s > float("-inf")
        w = tl.where(used, tl.exp(lse_s - lse_max), 0.0)
        o_mask = _tile_mask((offs_c < NUM_SPLITS)[:, None], offs_d[None, :] < HEAD_DIM, PAD_D)
        o_s = tl.load(O_PART + (row * NUM_SPLITS + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=o_mask, other=0.0)  # (CHUNK, HEAD_DIM_PAD), loaded with the lses
        o_s = tl.where(used[:, None], o_s, 0.0)  # an empty split weighs nothing, whatever it holds
        acc += tl.sum(o_s * w[:, None], 0)
        denom += w
    total = tl.sum(denom, 0)
    if HAS_SINK:  # one more term of the denominator, e^{sink}, with no value
        total += tl.exp(sink - lse_max)
    total_safe = tl.where(total > 0.0, total, 1.0)
    o = acc / total_safe  # (HEAD_DIM_PAD,)
    lse = tl.where(total > 0.0, lse_max + tl.log(total_safe), float("-inf"))
    if PAD_D:
        tl.store(out_ptr + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    else:
        tl.store(out_ptr + offs_d, o.to(out_ptr.dtype.element_ty))
    tl.store(LSE_OUT + row, lse)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, OUT, LSE_OUT, SINKS,  # SINKS (H,) fp32, read only with HAS_SINK
    H,
    stride_ob, stride_oh, stride_om,
    N_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr = 16, HAS_SINK: tl.constexpr = False,
):
    row = tl.program_id(0)  # (b·H + h)·N_Q + i
    bh, i = row // N_Q, row % N_Q
    b, h = bh // H, bh % H
    sink = 0.0
    if HAS_SINK:
        sink = tl.load(SINKS + h).to(tl.float32)
    _merge_row(O_PART, LSE_PART, row,
               OUT + b.to(tl.int64) * stride_ob + h * stride_oh + i * stride_om, LSE_OUT,
               sink, NUM_SPLITS, BLOCK_S, HEAD_DIM, CHUNK, HAS_SINK)
