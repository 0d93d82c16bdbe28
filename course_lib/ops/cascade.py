"""Cascade attention: requests that share a prompt prefix read it once.

Introduced in notebooks/16_serving.ipynb. When ``B`` requests start with the same ``P``-token
prefix (a system prompt, a few-shot preamble, the samples of one prompt), a decode step that
attends each request's whole context reads the prefix's K and V ``B`` times. Cascade attention
splits every query's keys in two and merges (FlashInfer's cascade inference: Ye et al.,
"Cascade Inference: Memory Bandwidth Efficient Shared Prefix Batch Decoding", 2024,
https://flashinfer.ai/2024/02/02/cascade-inference.html; Hydragen: Juravsky et al.,
"Hydragen: High-Throughput LLM Inference with Shared Prefixes", 2024,
https://arxiv.org/abs/2402.05099, section 3):

1. **The prefix, once, as one dense product.** Every query of every request, and every head
   of a GQA group, is a row of one matrix; it attends the ``P`` prefix keys with no mask (all
   of them come before every query). ``B·G·N_q`` rows against one K/V head: the prefix is read
   once per block of rows instead of once per request, and the product has rows enough for the
   tensor cores (``flash_attn_v2``). A few hundred rows make few programs, so the prefix's keys
   are cut into ``C`` chunks run side by side as a batch of ``C`` (``prefix_splits``), each
   leaving a partial (o, lse), as Flash-Decoding splits a cache (lesson 12).
2. **Each request's own suffix** (its tokens after the prefix, in the paged cache), causal among
   its ``N_q`` new queries: ``paged_decode``.
3. **The merge** of the (o, lse) pairs, lesson 12's log-sum-exp merge:
   ``lse = log(e^{lse_a} + e^{lse_b})``, ``o = e^{lse_a − lse}·o_a + e^{lse_b − lse}·o_b``
   (``merge_state``, FlashInfer's name), in one kernel for the C chunks and the suffix
   (``kernels/cascade.py``).

The result equals attention over the concatenated keys (prefix, then suffix) up to rounding.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-30 (one decode step: B
requests of one new token each, H 32, H_kv 8, D 128, fp16, a P-token prefix shared and 256
tokens of each request's own, pages of 16; both sides through one harness, ``do_bench`` median
of 5 rounds in turns; ``python -m course_lib.bench cascade``, course_lib/data/cascade.json).
Replayed as CUDA graphs (the GPU's time): B 64, P 4k: 61.2 µs against 197.3 µs for
``paged_decode`` over each request's whole context, 3.22× faster; P 16k 75.8 against 705.5 µs,
9.31×; P 1k 1.37×; B 16, P 4k 2.37×. Called eagerly the cascade's four launches cost the host
more than the GPU's work: 171.2 against 196.9 µs at B 64, P 4k (1.15×), 3.81× at P 16k.
"""
from __future__ import annotations

import torch
from torch import Tensor

from course_lib._device import INTERPRET
from course_lib.hardware import sm_count
from course_lib.kernels.attention_common import cdiv
from course_lib.kernels.cascade import merge_states
from course_lib.ops.attention import flash_attn_v2
from course_lib.ops.decode import paged_decode
from course_lib.validate import check_tensor

MIN_CHUNK = 256  # the fewest prefix keys a chunk of the dense product gets
ROWS_PER_PROGRAM = 64  # about the rows of one program of flash_attn_v2 (its BLOCK_M)


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions of the same queries over disjoint key sets, merged: (o, lse).

    o_a, o_b (..., D), each normalised over its own keys; lse_a, lse_b (...) their natural-log
    log-sum-exp (−inf where a row saw no key). Returns o (..., D) in o_a's dtype and lse (...)
    fp32, as if one attention had seen both key sets. A row that saw no key in either gets
    o = 0 and lse = −inf. One kernel (``kernels/cascade.py``).
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_state takes o (..., D) and lse (...) of the same rows, got o_a "
                         f"{tuple(o_a.shape)}, lse_a {tuple(lse_a.shape)}, o_b "
                         f"{tuple(o_b.shape)}, lse_b {tuple(lse_b.shape)}")
    if o_b.dtype != o_a.dtype or lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise TypeError(f"merge_state takes o_a and o_b of one dtype and fp32 lse, got "
                        f"{o_a.dtype}, {o_b.dtype}, {lse_a.dtype}, {lse_b.dtype}")
    D = o_a.shape[-1]
    o, lse = merge_states(o_a.reshape(1, -1, D).contiguous(), lse_a.reshape(1, -1).contiguous(),
                          o_b.reshape(-1, D).contiguous(), lse_b.reshape(-1).contiguous())
    return o.view(o_a.shape), lse.view(lse_a.shape)


def prefix_splits(rows: int, kv_heads: int, n_prefix: int) -> int:
    """Chunks of the prefix's keys: the largest power of two that keeps the dense product's
    programs (about ``rows / ROWS_PER_PROGRAM`` per chunk and K/V head) within two per SM,
    divides ``n_prefix`` and leaves ``MIN_CHUNK`` keys or more per chunk; 1 in the
    interpreter."""
    programs = cdiv(rows, ROWS_PER_PROGRAM) * kv_heads
    c = 1
    while (2 * c * programs <= 2 * sm_count(INTERPRET) and n_prefix % (2 * c) == 0
           and n_prefix // (2 * c) >= MIN_CHUNK):
        c *= 2
    return c


def cascade_decode(q, prefix_k, prefix_v, k_pages, v_pages, block_table, suffix_seqlens, *,
                   sm_scale=None, return_lse=False, num_prefix_splits=None):
    """Attention of B requests' new queries to a shared prefix and to each request's suffix.

    q (B, H, N_q, D): the N_q new tokens of each request (1 in a decode step), causal among
    themselves; prefix_k, prefix_v (H_kv, P, D): the prefix every request starts with;
    k_pages, v_pages (num_blocks, block_size, H_kv, D), block_table (B, max_blocks) int32 and
    suffix_seqlens (B,) int32: each request's keys after the prefix, its new tokens' last
    (``paged_decode``'s cache). Returns o (B, H, N_q, D), and with ``return_lse`` the lse
    (B, H, N_q) fp32: attention over the prefix followed by the request's suffix.
    ``num_prefix_splits``: chunks of the prefix's keys (None: ``prefix_splits``; it must
    divide P).
    """
    check_tensor("q", q, 4)
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        check_tensor(name, t, 3)
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k and prefix_v must have the same shape, got "
                         f"{tuple(prefix_k.shape)} and {tuple(prefix_v.shape)}")
    B, H, N_q, D = q.shape
    H_kv, P = prefix_k.shape[0], prefix_k.shape[1]
    if H % H_kv or prefix_k.shape[2] != D:
        raise ValueError(f"prefix_k {tuple(prefix_k.shape)} must be (H_kv, P, D) with H_kv "
                         f"dividing q's {H} heads and D = {D}")
    G, R = H // H_kv, H // H_kv * B * N_q  # R: the rows under each K/V head
    C = num_prefix_splits or prefix_splits(R, H_kv, P)
    if P % C:
        raise ValueError(f"num_prefix_splits = {C} must divide the prefix's {P} keys")
    # 1. the prefix: row (g, b, i) of K/V head h_kv (one copy of q), the C chunks of its keys
    # side by side as a batch of C (views: every chunk reads the same rows)
    rows = q.reshape(B, H_kv, G, N_q, D).permute(1, 2, 0, 3, 4).reshape(1, H_kv, R, D)
    chunks_k = prefix_k.reshape(H_kv, C, P // C, D).transpose(0, 1)  # (C, H_kv, P / C, D)
    chunks_v = prefix_v.reshape(H_kv, C, P // C, D).transpose(0, 1)
    o_p, lse_p = flash_attn_v2(rows.expand(C, -1, -1, -1), chunks_k, chunks_v, causal=False,
                               sm_scale=sm_scale, return_lse=True)  # (C, H_kv, R, D), (C, H_kv, R)
    # 2. each request's suffix, causal among its new queries
    o_s, lse_s = paged_decode(q, k_pages, v_pages, block_table, suffix_seqlens,
                              sm_scale=sm_scale, return_lse=True)  # (B, H, N_q, D), (B, H, N_q)
    # 3. the merge of the C + 1 partial results of every row
    o, lse = merge_states(o_p.reshape(C, H_kv * R, D), lse_p.reshape(C, H_kv * R),
                          o_s.reshape(-1, D).contiguous(), lse_s.reshape(-1), (B, H, N_q))
    o, lse = o.view(B, H, N_q, D), lse.view(B, H, N_q)
    return (o, lse) if return_lse else o


__all__ = ["cascade_decode", "merge_state", "prefix_splits"]
