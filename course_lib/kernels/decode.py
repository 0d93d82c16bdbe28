"""Decode attention: Flash-Decoding (split-KV + LSE merge) and PagedAttention, with GQA.

Introduced in notebooks/12_flash_decoding.ipynb (``flash_decode``) and
notebooks/13_paged_attention.ipynb (``paged_decode``); notebooks/11_kv_cache_gqa.ipynb explains
why decoding needs them.

The problem. At every generated token a model attends ``N_q`` new query tokens (1 for plain
decoding, a few when a draft is verified in speculative decoding) to the ``L_b`` keys and
values already in the cache of sequence ``b``. The FLOPs are tiny (4·H·N_q·L·D) and every byte
of K and V is read once: decoding is bound by memory bandwidth (arithmetic intensity
``H·N_q/H_kv`` FLOP per fp16 byte; see ``course_lib.iomodel.decode``). A FlashAttention forward
kernel like the course's ``flash_attn_v2`` launches one program per (batch, head, BLOCK_M query
rows): at batch 1 that is 32 programs for 132 SMs, each walking all ``L`` keys alone (measured in
course_lib/data/decode.json). The pieces below fix that, as FlashAttention's own decoding path
(``flash_attn_with_kvcache``) does.

The pieces
----------
``_decode_split_kernel`` (Flash-Decoding step 2, Dao et al., "Flash-Decoding for long-context
inference", 2023): grid ``(num_splits, B·H_kv, m_tiles)``. Program ``(s, b·H_kv + g, t)`` takes
split ``s`` of sequence ``b``'s keys (its ``L_b`` keys cut into ``num_splits`` runs of whole
``BLOCK_N`` tiles) and *all* query rows that read key/value head ``g``: the ``G = H/H_kv``
query heads of the GQA group times the ``N_q`` query tokens, ``G·N_q`` rows stacked in the M
dimension of ``tl.dot`` (padded to ``BLOCK_M`` >= 16). So each K/V tile is loaded from HBM
once and used by every query head that shares it. The loop is FlashAttention-2's online
softmax in base 2 (``qk_scale = sm_scale·log2(e)`` folded into the scores, ``exp2``), fp32
accumulators, causal masking of the ``N_q`` rows bottom-right aligned to ``L_b``. It writes the
split's *normalised* partial output ``o_s`` (fp32) and its natural-log ``lse_s``.

``_decode_merge_kernel`` (step 3): one program per query row combines the splits,
``lse = log Σ_s exp(lse_s)``, ``o = Σ_s exp(lse_s − lse)·o_s`` — the (m, d) merge of lesson 01
with (lse, o) in place of (m, d). Empty splits carry ``lse_s = −inf`` and weigh nothing.

``paged_decode`` uses the same two kernels with ``PAGED=True``: the only change is where row
``n`` of K/V lives. Contiguously it is ``k_cache[b, g, n]``; paged (PagedAttention: Kwon et al.
2023, §4.1; the layout ``flash_attn_with_kvcache`` takes with a ``block_table``)
it is ``k_pages[block_table[b, n // block_size], n % block_size, g]``. A ``BLOCK_N`` tile spans
``BLOCK_N / block_size`` pages: the kernel gathers the physical block id of each of its rows
(a cached load) and then loads the rows like any others.

Choosing the work split (``choose_num_splits``): ``num_splits`` is the largest power of two
that keeps the grid at or under ``PROGRAMS_PER_SM`` programs per SM
(``torch.cuda.get_device_properties().multi_processor_count``), never fewer than
``MIN_TILES_PER_SPLIT`` tiles of keys per split; the interpreter uses one small config
(``BLOCK_N`` = 16) and at most 4 splits. The launch config (BLOCK_N, num_warps, num_stages)
comes from ``DECODE_CONFIGS`` by head dim; ``config=`` overrides it (the benchmark's
``--tune`` sweeps them).

Plan and run (``make_plan``, ``run_plan``), in the manner of FlashInfer's ``plan()``/``run()``:
the split count, the launch config and the buffers are decided once per batch shape; a decode
step then only launches the two kernels, reads nothing back from the device and allocates
nothing, so it can be captured in a CUDA graph. The kernel clamps every length to [0, N_max] and
every block id to [0, num_blocks): a wrong value gives a wrong answer, never a read outside the
cache. The public, validated functions are ``course_lib.ops.flash_decode`` and ``paged_decode``.

Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-24 (N_q = 1, H = 32,
H_kv = 8, D = 128, fp16; every provider timed as a CUDA-graph replay, ``do_bench`` median, L2
flushed; course_lib/data/decode.json, which also has every eager time):
B 1, N 128k: 198 µs, 90% of the copy bandwidth (SDPA cuDNN 193 µs); B 1, N 4k: 18.8 µs
(SDPA cuDNN 18.8 µs).
paged_decode / flash_decode latency 1.02–1.07× at every shape. Called eagerly at N 4k the host's
work dominates: the two launches with their Python (lesson 12, section 8, and
course_lib/data/dropin.json measure it; course_lib/data/perf_notes.md tells the story).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib._launch import launch
from course_lib.reference import LOG2E

MAX_SPLITS = 256
PROGRAMS_PER_SM = 2
MIN_TILES_PER_SPLIT = 2

# (BLOCK_N, num_warps, num_stages) by head dim, for the GPU. A tile of K plus one of V is
# 2·BLOCK_N·D·2 bytes in fp16 (32 KiB for 64 × 128); num_stages tiles are kept in flight. A head
# dim that is not a power of two uses the row of the power of two its tiles are padded to.
DECODE_CONFIGS = {
    16: dict(BLOCK_N=128, num_warps=4, num_stages=3),
    32: dict(BLOCK_N=128, num_warps=4, num_stages=3),
    64: dict(BLOCK_N=128, num_warps=4, num_stages=3),
    128: dict(BLOCK_N=64, num_warps=4, num_stages=4),
    256: dict(BLOCK_N=32, num_warps=4, num_stages=3),
}
# Candidates the benchmark's --tune sweeps (for D = 128); the default above is one of them.
TUNE_CONFIGS = [
    dict(BLOCK_N=bn, num_warps=w, num_stages=s)
    for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    if not (bn == 128 and s == 4)  # 2 × 128 × 128 × 2 B × 4 stages = 256 KiB: over shared memory
]
INTERPRET_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
INTERPRET_MAX_SPLITS = 4  # the interpreter runs programs one after another: keep it small


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,  # contiguous: (B, H_kv, N) strides; paged: (block, head, slot)
    stride_vb, stride_vh, stride_vn,
    stride_btb,
    qk_scale, H, N_MAX, NUM_BLOCKS,
    N_Q: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    split = tl.program_id(0)
    bg = tl.program_id(1)  # b * H_kv + g
    m_tile = tl.program_id(2)
    h_kv = H // GROUP
    b = bg // h_kv
    g = bg % h_kv

    if HAS_SEQLENS:  # clamped to [0, N_MAX]: a wrong length cannot read past the cache
        seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N_MAX)
    else:
        seqlen = N_MAX
    # Split s owns whole BLOCK_N tiles [s·T, (s+1)·T) of this sequence's keys.
    n_tiles = tl.cdiv(seqlen, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seqlen)

    # Rows of this program: r = head_in_group · N_Q + query_index (G·N_Q rows per kv head).
    offs_r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = offs_r < GROUP * N_Q
    head = g * GROUP + offs_r // N_Q  # query head of each row
    qi = offs_r % N_Q  # query token of each row
    # tl.arange needs a power of two: D = 80 runs as 128 columns, the 48 past D masked (0)
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Causal, bottom-right aligned: query i sees keys n <= seqlen - N_Q + i.
    last_key = seqlen - N_Q + qi  # (BLOCK_M,)

    # Partial results are stored per (b, head, i, split): row id (b·H + head)·N_Q + i.
    part_row = (b * H + head) * N_Q + qi  # (BLOCK_M,)
    lse_ptrs = LSE_PART + part_row * NUM_SPLITS + split
    o_ptrs = O_PART + (part_row * NUM_SPLITS + split)[:, None] * HEAD_DIM + offs_d[None, :]

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
              + qi[:, None] * stride_qm + offs_d[None, :])
    if HEAD_DIM_PAD != HEAD_DIM:
        row_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    else:
        row_mask = row_ok[:, None]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    if PAGED:
        k_base = K + g * stride_kh
        v_base = V + g * stride_vh
        bt_base = BLOCK_TABLE + b.to(tl.int64) * stride_btb
    else:
        k_base = K + b.to(tl.int64) * stride_kb + g * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + g * stride_vh

    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical key positions
        n_ok = offs_n < end
        if PAGED:
            # logical token n -> (physical block, slot): the block table is the page table
            block = tl.load(bt_base + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            block = tl.minimum(tl.maximum(block, 0), NUM_BLOCKS - 1)  # never outside the pool
            slot = offs_n % PAGE_SIZE
            k_rows = block * stride_kb + slot * stride_kn  # (BLOCK_N,)
            v_rows = block * stride_vb + slot * stride_vn
        else:
            k_rows = offs_n.to(tl.int64) * stride_kn
            v_rows = offs_n.to(tl.int64) * stride_vn
        if HEAD_DIM_PAD != HEAD_DIM:
            kv_mask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        else:
            kv_mask = n_ok[:, None]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        visible = offs_n[None, :] <= last_key[:, None]  # causal and in range (n < seqlen)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # A split with no visible key (past a short sequence's end, or before a causal row's first
    # key) has l = 0: it stores lse = -inf and o = 0, and weighs nothing in the merge.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptrs, lse, mask=row_ok)
    tl.store(o_ptrs, o, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, OUT, LSE_OUT,
    H,
    stride_ob, stride_oh, stride_om,
    N_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr = 16,
):
    row = tl.program_id(0)  # (b·H + h)·N_Q + i
    i = row % N_Q
    bh = row // N_Q
    b = bh // H
    h = bh % H
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # columns past D masked
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # pass 1: the largest lse_s (empty splits hold -inf)
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS,
                      other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse_all, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    # pass 2: o = Σ_s e^{lse_s − lse_max} o_s / Σ_s e^{lse_s − lse_max}, CHUNK splits at a time
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    denom = tl.zeros([CHUNK], tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        lse_s = tl.load(LSE_PART + row * NUM_SPLITS + offs_c, mask=offs_c < NUM_SPLITS,
                        other=float("-inf"))  # (CHUNK,)
        used = lse_s > float("-inf")  # empty splits weigh nothing (their o_s is not read)
        w = tl.where(used, tl.exp(lse_s - lse_max), 0.0)
        if HEAD_DIM_PAD != HEAD_DIM:
            o_mask = used[:, None] & (offs_d[None, :] < HEAD_DIM)
        else:
            o_mask = used[:, None]
        o_s = tl.load(O_PART + (row * NUM_SPLITS + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=o_mask, other=0.0)  # (CHUNK, HEAD_DIM_PAD)
        acc += tl.sum(o_s * w[:, None], 0)
        denom += w
    total = tl.sum(denom, 0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    o = acc / total_safe  # (HEAD_DIM_PAD,)
    lse = tl.where(total > 0.0, lse_max + tl.log(total_safe), float("-inf"))
    out_ptrs = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + i * stride_om + offs_d
    if HEAD_DIM_PAD != HEAD_DIM:
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    else:
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty))
    tl.store(LSE_OUT + row, lse)


# ---------------------------------------------------------------------------------------------
# planning the launch
# ---------------------------------------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv's arithmetic, without its per-call wrapper cost


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int | None = None) -> int:
    if INTERPRET:
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(head_dim: int) -> dict:
    """The launch config (BLOCK_N, num_warps, num_stages) used for ``head_dim``: that of the
    power of two the kernels pad it to (D 80 runs D 128's tiles)."""
    return dict(INTERPRET_CONFIG) if INTERPRET else dict(DECODE_CONFIGS[_next_pow2(head_dim)])


def choose_num_splits(batch: int, kv_heads: int, n_keys: int, block_n: int,
                      sm_count: int | None = None, m_tiles: int = 1,
                      max_splits: int = MAX_SPLITS) -> int:
    """How many splits of the keys: the largest power of two that keeps the programs at or under
    ``PROGRAMS_PER_SM`` per SM, never tinier than MIN_TILES_PER_SPLIT tiles of ``block_n`` keys,
    at most ``max_splits``.

    Rounding *down* keeps the grid inside one wave of programs. Measured on an H100 (H_kv 8,
    D 128, B 8, N 32k): 9 splits (576 programs, just over what fits at once) made paged_decode
    23% slower than 8 splits; aiming at 4 programs per SM at batch 1 (64 splits) was 2-15%
    slower than 16 or 32 (course_lib/data/perf_notes.md).

    >>> choose_num_splits(1, 8, 131072, 64, sm_count=132)   # batch 1, long context
    32
    >>> choose_num_splits(8, 8, 131072, 64, sm_count=132)   # batch 8
    4
    >>> choose_num_splits(1, 8, 2048, 64, sm_count=132)     # short context: 2 tiles a split
    16
    """
    sms = sm_count if sm_count is not None else _sm_count()
    programs = batch * kv_heads * m_tiles
    wanted = 1 << max(0, (PROGRAMS_PER_SM * sms // programs).bit_length() - 1)
    most = max(1, _cdiv(n_keys, MIN_TILES_PER_SPLIT * block_n))
    return int(max(1, min(wanted, most, max_splits)))


def split_bounds(seqlen: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The key range [start, end) of every split of a sequence, as the split kernel cuts it:
    ``num_splits`` runs of ⌈⌈L/BLOCK_N⌉/num_splits⌉ whole tiles; the last runs may be empty.

    >>> split_bounds(100, 3, 16)    # 7 tiles: 3 + 3 + 1
    [(0, 48), (48, 96), (96, 100)]
    >>> split_bounds(20, 4, 16)     # 2 tiles: splits 2 and 3 get nothing
    [(0, 16), (16, 20), (32, 20), (48, 20)]
    """
    tiles_per_split = -(-(-(-seqlen // block_n)) // num_splits)
    out = []
    for s in range(num_splits):
        start = s * tiles_per_split * block_n
        out.append((start, min(start + tiles_per_split * block_n, seqlen)))
    return out


def _block_m(rows: int) -> int:
    """Rows of the M dimension per program: >= 16 (tl.dot's minimum), at most 64."""
    return max(16, min(64, _next_pow2(rows)))


# ---------------------------------------------------------------------------------------------
# plan and run: decide once per batch shape, then each decode step only launches
# ---------------------------------------------------------------------------------------------

def _empty(shape, device, dtype):
    """Every buffer a plan allocates (the tests replace this to poison them with NaN)."""
    return torch.empty(shape, device=device, dtype=dtype)


@dataclass
class SplitPlan:
    """What a decode step needs besides its tensors, decided once per batch shape: the split
    count, the launch config, the grids and the splits' scratch buffers (partial outputs and
    lses). ``run_plan`` then only launches the two kernels: no host computation, no allocation,
    no read of device memory, so a step can be captured in a CUDA graph.
    """

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
    o_part: torch.Tensor
    lse_part: torch.Tensor


def make_plan(B: int, H: int, H_kv: int, N_q: int, D: int, n_max: int, device, *,
              num_splits: int | None = None, config: dict | None = None, paged: bool = False,
              page_size: int = 1, num_blocks: int = 1, sm_count: int | None = None) -> SplitPlan:
    """A ``SplitPlan`` for caches of at most ``n_max`` keys (inputs already validated)."""
    cfg = dict(config) if config is not None else pick_config(D)
    rows = (H // H_kv) * N_q
    block_m = _block_m(rows)
    m_tiles = _cdiv(rows, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(B, H_kv, n_max, cfg["BLOCK_N"], sm_count=sm_count,
                                       m_tiles=m_tiles,
                                       max_splits=INTERPRET_MAX_SPLITS if INTERPRET else MAX_SPLITS)
    return SplitPlan(
        B, H, H_kv, N_q, D, n_max, paged, page_size, num_blocks, num_splits, block_m, m_tiles,
        cfg,
        o_part=_empty((B, H, N_q, num_splits, D), device=device, dtype=torch.float32),
        lse_part=_empty((B, H, N_q, num_splits), device=device, dtype=torch.float32))


def run_plan(plan: SplitPlan, q, k, v, seqlens, block_table, sm_scale: float, out, lse):
    """The two launches of a decode step: the split kernel, then the merge into ``out`` (B, H,
    N_q, D) and ``lse`` (B, H, N_q). ``k``, ``v``: (B, H_kv, N, D) contiguous-cache layout, or
    (num_blocks, block_size, H_kv, D) pages with ``block_table``; ``seqlens`` (B,) int32 or
    None. Launched through ``course_lib._launch.launch`` (Triton's host work once per key)."""
    if plan.paged:  # k (num_blocks, block_size, H_kv, D): block, slot, head strides
        skb, skn, skh = k.stride(0), k.stride(1), k.stride(2)
        svb, svn, svh = v.stride(0), v.stride(1), v.stride(2)
        stride_bt = block_table.stride(0)
    else:  # k (B, H_kv, N, D)
        skb, skh, skn = k.stride(0), k.stride(1), k.stride(2)
        svb, svh, svn = v.stride(0), v.stride(1), v.stride(2)
        stride_bt = 0
    cfg, B, H, N_q, D = plan.config, plan.B, plan.H, plan.N_q, plan.D
    has_seqlens = seqlens is not None
    launch(_decode_split_kernel, (plan.num_splits, B * plan.H_kv, plan.m_tiles),
           q, k, v, seqlens if has_seqlens else q, block_table if plan.paged else q,
           plan.o_part, plan.lse_part,
           q.stride(0), q.stride(1), q.stride(2),
           skb, skh, skn, svb, svh, svn, stride_bt,
           sm_scale * LOG2E, H, plan.n_max, plan.num_blocks,
           N_Q=N_q, GROUP=H // plan.H_kv, NUM_SPLITS=plan.num_splits, HEAD_DIM=D,
           BLOCK_M=plan.block_m, BLOCK_N=cfg["BLOCK_N"], PAGED=plan.paged,
           PAGE_SIZE=plan.page_size, HAS_SEQLENS=has_seqlens, IEEE_DOT=q.dtype == torch.float32,
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    launch(_decode_merge_kernel, (B * H * N_q,),
           plan.o_part, plan.lse_part, out, lse, H,
           out.stride(0), out.stride(1), out.stride(2),
           N_Q=N_q, NUM_SPLITS=plan.num_splits, BLOCK_S=_next_pow2(plan.num_splits),
           HEAD_DIM=D, CHUNK=min(16, _next_pow2(plan.num_splits)),
           num_warps=4 if D >= 128 else 2)
    return out, lse
