"""Cascade attention's merge: the prefix's partial results and each request's suffix, one answer.

notebooks/16_serving.ipynb (``course_lib.ops.cascade``). The shared prefix is attended as one
dense product split into ``C`` chunks of keys (``C`` programs' worth of parallelism where B
requests give few rows); each chunk leaves a normalised ``o_c`` and its natural-log ``lse_c``
for every query row, and the suffix leaves one more pair. This kernel merges the ``C + 1``
pairs of each row, lesson 12's log-sum-exp merge (``decode_merge.py`` does the same for the
splits of one sequence):

    lse = log(Σ_c e^{lse_c} + e^{lse_s}),   o = Σ_c e^{lse_c − lse}·o_c + e^{lse_s − lse}·o_s

The row order differs between the two sides. The suffix's rows are ``(b, h, i)``: request,
query head, new token, ``paged_decode``'s (B, H, N_q, D). The prefix product stacks every head
of a GQA group and every request under its K/V head, so its rows are ``(h, b, i)`` (head
``h = h_kv·G + g``): with ``GROUPED`` the kernel reads prefix row ``(h·B + b)·N_q + i`` for
output row ``(b·H + h)·N_q + i``. Without it both sides share the row order (``merge_state``).

Grid: ``(⌈rows / BLOCK_R⌉,)``, BLOCK_R rows of HEAD_DIM each. Speed: not benchmarked on its own;
``ops.cascade`` states what the whole cascade step measures.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.kernels.attention_common import cdiv, interpreter_errstate


@triton.jit
def _cascade_merge_kernel(O_A, LSE_A, O_B, LSE_B, O, LSE, ROWS, stride_ao, stride_al, B, H, N_Q,
                          NUM_A: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                          GROUPED: tl.constexpr):
    """Rows of O (ROWS, HEAD_DIM) and LSE (ROWS,): the NUM_A states of side A (state c at
    O_A + c·stride_ao, LSE_A + c·stride_al) merged with the one state of side B. The loops
    over the states are unrolled (``tl.static_range``): their loads go out together."""
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) output rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    r_ok = offs_r < ROWS
    mask = r_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if GROUPED:  # output row (b, h, i) -> prefix row (h, b, i)
        i = offs_r % N_Q
        h = (offs_r // N_Q) % H
        b = offs_r // (N_Q * H)
        rows_a = (h * B + b) * N_Q + i
    else:
        rows_a = offs_r
    # pass 1: the largest lse of each row (-inf where no state saw a key)
    lse_b = tl.load(LSE_B + offs_r, mask=r_ok, other=float("-inf"))
    lse_max = lse_b
    for c in tl.static_range(NUM_A):
        lse_c = tl.load(LSE_A + c * stride_al + rows_a, mask=r_ok, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_c)
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row with no key: weights 0
    # pass 2: the weighted sum, every weight e^{lse − max} <= 1
    w = tl.exp(lse_b - ref)
    denom = w
    acc = w[:, None] * tl.load(O_B + offs_r[:, None] * HEAD_DIM + offs_d[None, :], mask=mask,
                               other=0.0).to(tl.float32)
    for c in tl.static_range(NUM_A):
        lse_c = tl.load(LSE_A + c * stride_al + rows_a, mask=r_ok, other=float("-inf"))
        w = tl.exp(lse_c - ref)
        o_c = tl.load(O_A + c * stride_ao + rows_a[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=mask, other=0.0)
        acc += w[:, None] * o_c.to(tl.float32)
        denom += w
    o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    lse = tl.where(denom == 0.0, float("-inf"), ref + tl.log(denom))
    tl.store(O + offs_r[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=mask)
    tl.store(LSE + offs_r, lse, mask=r_ok)


BLOCK_R = 16


def merge_states(o_a, lse_a, o_b, lse_b, grouped: tuple[int, int, int] | None = None):
    """(o, lse) of rows merged from side A's states and side B's one state.

    o_a (C, rows, D), lse_a (C, rows): C states of every row (C >= 1), each contiguous in its
    last two dims; o_b (rows, D) and lse_b (rows,) contiguous. ``grouped`` = (B, H, N_q): side
    A's rows are in the prefix product's (h, b, i) order and side B's, and the output's, in
    (b, h, i) order. Returns o (rows, D) in o_b's dtype and lse (rows,) fp32."""
    rows, D = o_b.shape
    o = torch.empty_like(o_b)
    lse = torch.empty(rows, device=o_b.device, dtype=torch.float32)
    B, H, N_q = grouped or (1, 1, 1)
    with interpreter_errstate():
        _cascade_merge_kernel[(cdiv(rows, BLOCK_R),)](
            o_a, lse_a, o_b, lse_b, o, lse, rows, o_a.stride(0), lse_a.stride(0), B, H, N_q,
            NUM_A=o_a.shape[0], HEAD_DIM=D, BLOCK_R=BLOCK_R, GROUPED=grouped is not None)
    return o, lse


__all__ = ["merge_states"]
