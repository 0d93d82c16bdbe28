"""Exercises of notebooks/11_kv_cache_gqa.ipynb, 12_flash_decoding.ipynb and
13_paged_attention.ipynb.

* 11: ``check_kv_bytes_per_token`` — the KV cache's bytes per token of a model shape;
* 12: ``check_merge_partials`` — Flash-Decoding's reduction: merge per-split (o_s, lse_s);
* 13: ``check_physical_slot`` — a block table lookup: logical position -> (block, offset);
  ``check_shared_blocks`` — blocks used by parallel samples sharing their prompt.

The reference solutions are the ``*_solution`` functions below (tested in
tests/test_decode.py and tests/test_kvcache.py); the notebooks do not show them.
"""
from __future__ import annotations

import math

import numpy as np

from course_lib.exercises import Result, check

# ------------------------------------------------------------------------------ lesson 11

KV_HINT = ("every layer stores one key and one value vector per K/V head: "
           "2 · n_layers · n_kv_heads · head_dim numbers, each bytes_per_el bytes")


def kv_bytes_per_token_solution(n_layers, n_kv_heads, head_dim, bytes_per_el=2):
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_el


def check_kv_bytes_per_token(student) -> Result:
    """``student(n_layers, n_kv_heads, head_dim, bytes_per_el) -> bytes`` per token."""
    cases = [(32, 32, 128, 2),   # Llama-2-7B, fp16
             (40, 40, 128, 2),   # Llama-2-13B
             (80, 8, 128, 2),    # Llama-2-70B (GQA)
             (48, 8, 128, 1),    # Qwen2.5-14B with an 8-bit cache
             (24, 1, 64, 4)]     # MQA, fp32
    return check("KV bytes per token", student, kv_bytes_per_token_solution, cases, hint=KV_HINT)


# ------------------------------------------------------------------------------ lesson 12

MERGE_HINT = ("lse = log Σ_s e^(lse_s) (subtract the largest lse_s first, as in a safe "
              "log-sum-exp); each split's weight is e^(lse_s - lse); o = Σ_s weight_s · o_s. "
              "Return (o, lse)")
MERGE_EMPTY_HINT = ("an empty split has lse_s = -inf and an o_s that may be anything (even NaN): "
                    "give it weight 0 without multiplying its o_s (np.where), and if every split "
                    "is empty return o = 0, lse = -inf")


def merge_partials_solution(o_parts, lse_parts):
    """o_parts (S, D) normalised per split, lse_parts (S,) -> (o (D,), lse scalar)."""
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    used = np.isfinite(lse_parts)
    if not used.any():
        return np.zeros(o_parts.shape[-1]), -np.inf
    top = lse_parts[used].max()
    w = np.where(used, np.exp(np.where(used, lse_parts, top) - top), 0.0)
    total = w.sum()
    o = (w[:, None] * np.where(used[:, None], o_parts, 0.0)).sum(axis=0) / total
    return o, float(top + np.log(total))


def _split_case(rng, n, bounds, d=4, scale=1.0):
    s = rng.standard_normal(n) * scale
    v = rng.standard_normal((n, d))
    o_parts, lse_parts = [], []
    for lo, hi in bounds:
        if lo >= hi:
            o_parts.append(np.full(d, np.nan))
            lse_parts.append(-np.inf)
            continue
        p = np.exp(s[lo:hi] - s[lo:hi].max())
        o_parts.append(p @ v[lo:hi] / p.sum())
        lse_parts.append(s[lo:hi].max() + np.log(p.sum()))
    return np.array(o_parts), np.array(lse_parts)


def check_merge_partials(student) -> Result:
    """``student(o_parts, lse_parts) -> (o, lse)``: merge the splits of one query row."""
    rng = np.random.default_rng(12)
    plain = [_split_case(rng, 40, [(0, 10), (10, 25), (25, 40)]),
             _split_case(rng, 64, [(0, 64)]),
             _split_case(rng, 30, [(0, 16), (16, 30)], scale=300.0)]  # e^lse overflows
    first = check("merge partials", student, merge_partials_solution, plain, hint=MERGE_HINT,
                  rtol=1e-9, atol=1e-12)
    if not first:
        return first
    empty = [_split_case(rng, 20, [(0, 16), (16, 20), (32, 20)]),
             (np.full((2, 4), np.nan), np.array([-np.inf, -np.inf]))]
    return check("merge partials, empty splits", student, merge_partials_solution, empty,
                 hint=MERGE_EMPTY_HINT, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------ lesson 13

SLOT_HINT = ("logical block j = position // block_size holds the token at offset "
             "position % block_size; the block table maps j to the physical block: "
             "return (block_table[j], offset)")
SHARED_HINT = ("the prompt's full blocks are stored once; the prompt's last, partly filled "
               "block is shared too until a sample writes to it: every sample but the last "
               "to write copies it (copy-on-write); then each sample needs its own blocks for "
               "the rest of its tokens. Count physical blocks in use at the end")


def physical_slot_solution(block_table_row, position, block_size=16):
    j, offset = divmod(int(position), int(block_size))
    return int(block_table_row[j]), offset


def check_physical_slot(student) -> Result:
    """``student(block_table_row, position, block_size) -> (block, offset)``."""
    row = [7, 2, 9, 4]
    cases = [(row, 0, 16), (row, 15, 16), (row, 16, 16), (row, 63, 16), (row, 37, 16),
             ([3, 1, 0], 5, 2)]
    return check("physical slot", student, physical_slot_solution, cases, hint=SLOT_HINT)


def shared_blocks_solution(prompt_len, output_lens, block_size=16):
    """Physical blocks used by len(output_lens) samples sharing a prompt of prompt_len tokens."""
    full, partial = divmod(prompt_len, block_size)
    blocks = full + (1 if partial else 0)  # the prompt, once
    for out in output_lens:
        total = prompt_len + out
        blocks += math.ceil(total / block_size) - full - (1 if partial else 0)
    if partial:  # a sample writing into the shared partial block copies it while others
        writers = sum(1 for out in output_lens if out > 0)  # still hold it: all writers but
        blocks += min(writers, len(output_lens) - 1)         # the last sample, if it writes
    return blocks


def check_shared_blocks(student) -> Result:
    """``student(prompt_len, output_lens, block_size) -> blocks in use``."""
    cases = [(32, [10, 10], 16),        # the prompt fills its blocks: nothing to copy
             (100, [50, 50, 50, 50], 16),
             (20, [1, 1, 1], 16),
             (5, [30], 16),
             (64, [0, 16], 16)]
    return check("blocks with a shared prompt", student, shared_blocks_solution, cases,
                 hint=SHARED_HINT)
