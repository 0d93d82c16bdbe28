"""Planning a decode step: how many splits, which tile config, which scratch buffers.

Introduced in notebooks/12_flash_decoding.ipynb (the split count, section 5's dealt tiles) and
tuned in notebooks/12a_decode_tuning.ipynb (the tiles by the GPU's bandwidth). The split kernel,
``_decode_split_kernel`` in ``course_lib.kernels.decode``, and its ``run_plan`` launch what
``make_plan`` decides here, once per batch shape, as FlashInfer's ``plan()`` does before its
``run()`` (FlashInfer project, "flashinfer.decode", https://docs.flashinfer.ai/api/decode.html).
``split_bounds`` is how the keys are cut into splits, and ``_split_range`` its twin in the
kernel, the one jit function of this file.

This file is not benchmarked on its own: the speed of the launches it plans is in
``kernels/decode.py``'s docstring, and how the rules below were measured in
course_lib/data/perf_notes.md. ``course_lib.kernels.decode`` re-exports every name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib.hardware import bandwidth_per_sm
from course_lib.hardware import sm_count as _sm_count
from course_lib.kernels.attention_common import cdiv, next_pow2

MAX_SPLITS = 256
PROGRAMS_PER_SM = 1  # the split count's aim: one wave of one program per SM (choose_num_splits)
TWO_STAGE_PROGRAMS_PER_SM = 2  # past this many unsplit programs per SM, two stages (pick_config)
MIN_TILES_PER_SPLIT = 2
# Loads' latency with the memory busy, for Little's law (pick_config): on the H100, 64 KiB in
# flight per SM streamed as fast as more, at 25.4 GB/s per SM: 64 KiB / 25.4 GB/s = 2.6 µs
# (course_lib/data/perf_notes.md, "Decode tiles chosen by the GPU's own bandwidth").
LOADED_LATENCY_S = 2.5e-6
# From this many splits of a cache of this many tiles on, the splits take the tiles round-robin:
# faster at every shape measured of 256 tiles or more, slower or even at 64-128 (decode_splits).
INTERLEAVE_MIN_SPLITS, INTERLEAVE_MIN_TILES = 2, 256

# (BLOCK_N, num_warps, num_stages) by head dim, for the GPU. A tile of K plus one of V is
# 2·BLOCK_N·D·2 bytes in fp16 (32 KiB for 64 × 128); a program buffers num_stages of them,
# num_stages − 1 in flight ahead of the one it computes on (``bytes_in_flight``). A head
# dim that is not a power of two uses the row of the power of two its tiles are padded to.
DECODE_CONFIGS = {d: dict(BLOCK_N=128, num_warps=4, num_stages=3) for d in (16, 32, 64)}
DECODE_CONFIGS[128] = dict(BLOCK_N=64, num_warps=4, num_stages=3)  # pick_config refines it
DECODE_CONFIGS[256] = dict(BLOCK_N=32, num_warps=4, num_stages=3)
INTERPRET_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
# The merge: by the last split of a group of rows ("fused") or a second kernel ("kernel"). "auto"
# fuses, but in a plan made in a CUDA-graph capture (zeroing the counters would add a node).
MERGES = ("fused", "kernel")
INTERPRET_MAX_SPLITS = 4  # the interpreter runs programs one after another: keep it small


# ---------------------------------------------------------------------------------------------
# planning the launch
# ---------------------------------------------------------------------------------------------

def bytes_in_flight(config: dict, head_dim: int, programs_per_sm: int = 1) -> int:
    """K and V bytes (2 each) an SM has asked for ahead: ``num_stages - 1`` tiles per program."""
    return programs_per_sm * (config["num_stages"] - 1) * 2 * config["BLOCK_N"] * head_dim * 2


def pick_config(head_dim: int, batch: int | None = None, kv_heads: int = 1,
                n_keys: int = 0, m_tiles: int = 1, sm_count: int | None = None,
                bandwidth_per_sm_: float | None = None, kv_bytes: int = 2) -> dict:
    """(BLOCK_N, num_warps, num_stages) for ``head_dim``: that of the power of two the kernels
    pad it to. For D 128 and a given work (``batch`` ...): one split per sequence and over
    ``TWO_STAGE_PROGRAMS_PER_SM`` programs per SM, 64-key tiles in two stages (more programs
    resident); splits of at most two 64-key tiles, 128-key tiles; else three stages of 64-key
    tiles, unless they put fewer bytes in flight than Little's law asks of this GPU (bandwidth
    per SM × ``LOADED_LATENCY_S``; ``bandwidth_per_sm_`` overrides the device's) and the split
    is long enough to fill the pipeline (six 128-key tiles): then 128-key tiles. An H100 gets
    64-key tiles, an H200 (1.44× the bandwidth) 128 (data/decode_tiles_h200.json).

    ``kv_bytes`` 1, an 8-bit cache (``course_lib.kvquant``) at D 128: the fp16 choice with twice
    the keys per tile (the same bytes) and 8 warps for the tile's conversion to q's dtype:
    1.19–1.27× the fp16 cache's step with e4m3 at N 32k–128k on an H200, against 1.13–1.22×
    with the fp16 tiles (data/kv_quant_tiles.json; perf_notes.md, "An 8-bit KV cache in the
    decode loop")."""
    if INTERPRET:
        return dict(INTERPRET_CONFIG)
    if kv_bytes == 1 and next_pow2(head_dim) == 128 and batch is not None:
        config = pick_config(head_dim, batch, kv_heads, n_keys, m_tiles, sm_count,
                             bandwidth_per_sm_)
        return dict(config, BLOCK_N=2 * config["BLOCK_N"], num_warps=8)
    if next_pow2(head_dim) != 128 or batch is None:
        return dict(DECODE_CONFIGS[next_pow2(head_dim)])
    sms = sm_count if sm_count is not None else _sm_count(INTERPRET)
    splits = choose_num_splits(batch, kv_heads, n_keys, 64, sm_count=sms, m_tiles=m_tiles)
    programs = batch * kv_heads * m_tiles
    if splits == 1 and programs > TWO_STAGE_PROGRAMS_PER_SM * sms:
        return dict(BLOCK_N=64, num_warps=4, num_stages=2)
    small, large = (dict(BLOCK_N=64, num_warps=4, num_stages=3),
                    dict(BLOCK_N=128, num_warps=4, num_stages=3))
    if cdiv(n_keys, 64 * splits) <= 2:
        return large
    bandwidth = bandwidth_per_sm(INTERPRET) if bandwidth_per_sm_ is None else bandwidth_per_sm_
    per_sm = cdiv(programs * splits, sms)
    long_splits = cdiv(n_keys, large["BLOCK_N"] * splits) >= 2 * large["num_stages"]
    if (bandwidth and long_splits
            and bytes_in_flight(small, head_dim, per_sm) < bandwidth * LOADED_LATENCY_S):
        return large  # Little's law: 64-key tiles keep too few bytes in flight for this GPU
    return small


def choose_num_splits(batch: int, kv_heads: int, n_keys: int, block_n: int,
                      sm_count: int | None = None, m_tiles: int = 1,
                      max_splits: int = MAX_SPLITS) -> int:
    """How many splits of the keys: the largest power of two that keeps the programs at or under
    ``PROGRAMS_PER_SM`` per SM, never tinier than MIN_TILES_PER_SPLIT tiles of ``block_n`` keys,
    at most ``max_splits``.

    Rounding *down* keeps the grid inside one wave of programs: a grid just over one wave, or
    aimed at two or four programs per SM, was slower (data/decode_splits.json, perf_notes.md).

    >>> [choose_num_splits(b, 8, n, 64, sm_count=132) for b, n in ((1, 131072), (8, 131072))]
    [16, 2]
    """
    sms = sm_count if sm_count is not None else _sm_count(INTERPRET)
    programs = batch * kv_heads * m_tiles
    wanted = 1 << max(0, (PROGRAMS_PER_SM * sms // programs).bit_length() - 1)
    most = max(1, cdiv(n_keys, MIN_TILES_PER_SPLIT * block_n))
    return int(max(1, min(wanted, most, max_splits)))


def split_bounds(seqlen: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """Each split's key range [start, end): ``num_splits`` runs of ⌈⌈L/BLOCK_N⌉/num_splits⌉ whole
    tiles, the last may be empty; the kernel's cut unless the plan deals the tiles (``make_plan``).

    >>> split_bounds(100, 3, 16)    # 7 tiles: 3 + 3 + 1
    [(0, 48), (48, 96), (96, 100)]
    >>> split_bounds(20, 4, 16)     # 2 tiles: splits 2 and 3 get nothing
    [(0, 16), (16, 20), (32, 20), (48, 20)]
    """
    run = cdiv(cdiv(seqlen, block_n), num_splits) * block_n  # keys per split
    return [(s * run, min((s + 1) * run, seqlen)) for s in range(num_splits)]


@triton.jit
def _split_range(split, lo, seqlen, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """(start, end) of split ``split``'s keys of [lo, seqlen), the kernel's ``split_bounds``: a
    run of whole BLOCK_N tiles; with INTERLEAVED the tiles dealt round-robin, split s taking
    tiles s, s + S, s + 2S, ... (the loop from ``start`` then steps NUM_SPLITS · BLOCK_N)."""
    if INTERLEAVED:
        start = lo + split * BLOCK_N
        end = seqlen
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(seqlen - lo, BLOCK_N), NUM_SPLITS)
        start = lo + split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seqlen)
    return start, end


# ---------------------------------------------------------------------------------------------
# the plan: decided once per batch shape, then each decode step only launches
# ---------------------------------------------------------------------------------------------

@dataclass
class SplitPlan:
    """What a decode step needs besides its tensors, decided once per batch shape: split count,
    launch config and scratch buffers. ``run_plan`` then only launches: no allocation, no read
    of device memory, so a step can be captured in a CUDA graph."""

    B: int
    H: int
    H_kv: int
    N_q: int
    D: int
    n_max: int
    paged: bool
    page_size: int
    num_blocks: int
    num_splits: int
    block_m: int
    m_tiles: int
    config: dict
    merge: str
    o_part: torch.Tensor | None  # None with one split (no scratch)
    lse_part: torch.Tensor | None
    arrived: torch.Tensor | None
    interleaved: bool = False  # tiles dealt to the splits round-robin (``make_plan``)
    window: tuple = (-1, 0)  # the variants' window (left, 0): ``make_plan``


def make_plan(B: int, H: int, H_kv: int, N_q: int, D: int, n_max: int, device, *,
              num_splits: int | None = None, config: dict | None = None, paged: bool = False,
              page_size: int = 1, num_blocks: int = 1, sm_count: int | None = None,
              merge: str = "auto", interleaved: bool | None = None,
              window: tuple = (-1, 0), kv_bytes: int = 2) -> SplitPlan:
    """A ``SplitPlan`` for caches of at most ``n_max`` keys (inputs already validated), with the
    variants' ``window`` (left, 0): a window bounds the work a sequence's splits share to
    left + N_q keys, and the split count and config are chosen for that.

    ``merge``: "auto" or one of ``MERGES``, which says what each does and what "auto" picks.
    ``interleaved``: deal the tiles round-robin (None: from ``INTERLEAVE_MIN_SPLITS`` splits of a
    cache of ``INTERLEAVE_MIN_TILES`` tiles on). ``kv_bytes``: bytes of one cached value (1: an
    8-bit cache, ``pick_config``)."""
    if merge not in ("auto", *MERGES):
        raise ValueError(f"merge must be one of {('auto', *MERGES)}, got {merge!r}")
    if merge == "auto":  # fused, unless its counters would be zeroed inside a CUDA-graph capture
        merge = "kernel" if capturing() else "fused"
    rows = (H // H_kv) * N_q
    block_m = max(16, min(64, next_pow2(rows)))  # rows per program: >= 16, tl.dot's minimum
    m_tiles = cdiv(rows, block_m)
    n_work = n_max if window[0] < 0 else min(n_max, window[0] + N_q)  # keys a sequence reads
    cfg = (dict(config) if config is not None
           else pick_config(D, B, H_kv, n_work, m_tiles, sm_count=sm_count, kv_bytes=kv_bytes))
    if num_splits is None:
        num_splits = choose_num_splits(B, H_kv, n_work, cfg["BLOCK_N"], sm_count=sm_count,
                                       m_tiles=m_tiles,
                                       max_splits=INTERPRET_MAX_SPLITS if INTERPRET else MAX_SPLITS)
    plan = SplitPlan(B, H, H_kv, N_q, D, n_max, paged, page_size, num_blocks, num_splits,
                     block_m, m_tiles, cfg, merge, o_part=None, lse_part=None, arrived=None,
                     window=tuple(window))
    plan.interleaved = (num_splits >= INTERLEAVE_MIN_SPLITS
                        and cdiv(n_work, cfg["BLOCK_N"]) >= INTERLEAVE_MIN_TILES
                        if interleaved is None else interleaved)
    if num_splits > 1:  # scratch for the partials (one split writes the answer directly)
        plan.o_part = torch.empty((B, H, N_q, num_splits, D), device=device, dtype=torch.float32)
        plan.lse_part = torch.empty((B, H, N_q, num_splits), device=device, dtype=torch.float32)
        # one arrival counter per (sequence, kv head, row tile), 0 between launches
        plan.arrived = (torch.zeros(B * H_kv * m_tiles, device=device, dtype=torch.int32)
                        if merge != "kernel" else torch.empty(1, device=device, dtype=torch.int32))
    return plan


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return not INTERPRET and torch._C._cuda_isCurrentStreamCapturing()  # (no Python wrapper)
