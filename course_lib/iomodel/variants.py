"""The work and the HBM traffic of the variants' forward, counted block by block.

For notebooks/15_attention_variants.ipynb. A tiled forward (``kernels.flash_variants``)
cuts the scores into BLOCK_M × BLOCK_N tiles. Under a window (causal is ``right = 0``) each tile is
skipped, run unmasked or run masked (``course_lib.masks.block_kind``); only the tiles it runs load
their K and V blocks and cost tensor-core FLOPs. Counted here, per (batch, head):

* ``blocks``: how many tiles of each kind;
* ``visible_pairs``: the (query, key) pairs the window lets a row see: the useful work, the FLOPs
  a throughput "on the visited area" counts (4·d per pair, as ``reference.attention_flops``);
* ``computed_pairs``: the pairs the tiles it runs compute, masked ones included (the edges of
  the sequence clipped): what the GPU does;
* ``read_bytes``, ``write_bytes``, ``hbm_bytes`` (as ``iomodel.attention``'s): Q read once, K
  and V once per tile run (before any reuse in L2), O and the lse written once.
"""
from __future__ import annotations

import math

from course_lib import masks


def block_map(N_q: int, N_k: int, block_m: int, block_n: int, window) -> list[list[str]]:
    """``kind[i][j]`` of the tile of query block i and key block j: "skipped", "unmasked" or
    "masked" (``masks.block_kind``), for a normalised ``window``."""
    return [[masks.block_kind(r0, min(r0 + block_m, N_q), c0, c0 + block_n, N_q, N_k, window)
             for c0 in range(0, N_k, block_n)] for r0 in range(0, N_q, block_m)]


def variant_io(N_q: int, N_k: int, d: int, block_m: int, block_n: int, window, B: int = 1,
               H: int = 1, bytes_per_el: int = 2, stats_bytes: int = 4) -> dict:
    """The counts of the module docstring for B·H heads; FLOPs as 4·d per (query, key) pair."""
    kinds = block_map(N_q, N_k, block_m, block_n, window)
    blocks = {"skipped": 0, "unmasked": 0, "masked": 0}
    computed = key_loads = 0
    for i, row in enumerate(kinds):
        rows = min(block_m, N_q - i * block_m)
        for j, kind in enumerate(row):
            blocks[kind] += 1
            if kind != "skipped":
                keys = min(block_n, N_k - j * block_n)
                computed += rows * keys
                key_loads += keys
    visible = masks.visible_pairs(N_q, N_k, window)
    bh = B * H
    reads = bh * (N_q * d + 2 * key_loads * d) * bytes_per_el
    writes = bh * (N_q * d * bytes_per_el + N_q * stats_bytes)
    return {"blocks": {k: v * bh for k, v in blocks.items()},
            "visible_pairs": visible * bh, "computed_pairs": computed * bh,
            "visible_flops": 4.0 * d * visible * bh, "computed_flops": 4.0 * d * computed * bh,
            "read_bytes": reads, "write_bytes": writes, "hbm_bytes": reads + writes,
            "tiles": (math.ceil(N_q / block_m), math.ceil(N_k / block_n))}
