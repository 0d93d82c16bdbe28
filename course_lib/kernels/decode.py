"""Decode attention: Flash-Decoding (split-KV + LSE merge) and PagedAttention, with GQA.

notebooks/12_flash_decoding.ipynb (``flash_decode``) and 13 (``paged_decode``); lesson 11 says why
decoding needs them: ``N_q`` new query tokens (1, or a few when a draft is verified) attend to the
``L_b`` cached keys of sequence ``b``. Every byte of K and V is read once for few FLOPs, so
decoding is bound by memory bandwidth; a forward kernel like ``flash_attn_v2`` has one program per
(batch, head, BLOCK_M rows): 32 programs for 132 SMs at batch 1 (course_lib/data/decode.json).

``_decode_split_kernel`` (Flash-Decoding, Dao et al., "Flash-Decoding for long-context inference",
2023): grid ``(num_splits, B·H_kv, m_tiles)``. Program ``(s, b·H_kv + g, t)`` takes split ``s`` of
sequence ``b``'s keys in whole ``BLOCK_N`` tiles (a run of them, or with ``INTERLEAVED`` every
``num_splits``-th tile) for *all* query rows that read K/V head ``g``: the ``G = H/H_kv`` heads of
the GQA group times the ``N_q`` queries, stacked in the M dimension of ``tl.dot``, so each K/V
tile is read from HBM once. The loop is FlashAttention-2's online softmax in base 2, causal among
the ``N_q`` rows (bottom-right aligned to ``L_b``). It writes the split's normalised ``o_s``
(fp32) and its natural-log ``lse_s``; a single split writes the answer itself.

The merge (``decode_merge.py``: lesson 01's (m, d) merge) ends the split kernel (``FUSED_MERGE``)
or is a kernel of its own (``MERGES``). Fused, each program counts itself in with an atomic add
on its rows' counter (release-acquire, after a barrier: NVIDIA's threadFenceReduction CUDA
sample); the last one merges the rows (``_merge_rows``) and resets the counter to 0.

Lesson 15's variants come as one tuple, ``VARIANT`` (``band.variant_args``), whose absent
fields compile to nothing: the cap and the ALiBi bias (``_variant_scores``), the sink joining the
denominator in the merge (or in the split kernel where it is the only split). ``WINDOW``, a
window (left, 0): the splits cut only the band [lo, L_b), so a sliding-window step reads
left + N_q keys, not L_b.

``PAGED=True``: row ``n`` of K/V lives at ``k_pages[block_table[b, n // block_size], n %
block_size, g]`` (PagedAttention: Kwon et al. 2023, §4.1). ``make_plan`` (``decode_plan.py``,
whose names this module re-exports) decides the split count, config and buffers once per batch
shape and ``run_plan`` only launches (FlashInfer's ``plan()`` and ``run()``), so a step can be
captured in a CUDA graph. The kernel clamps lengths and block ids: a wrong value gives a wrong
answer, never a read outside the cache. The validated functions are
``course_lib.ops.flash_decode`` and ``paged_decode``.

``KV_SCALED=True``: an 8-bit cache (int8 or e4m3, ``course_lib.kvquant``) with one fp32 scale
per token and head, ``K_SCALE``/``V_SCALE`` laid out like the cache without D. Both formats'
values are exact in fp16 and bf16, so a tile is converted to q's dtype as loaded and the scales
act outside the products: S = (q · k̂ᵀ) · k_scale[None, :] and P · V = (P · v_scale[None, :]) · v̂.
Half the bytes of an fp16 cache, plus 8 bytes per token and head. Measured on NVIDIA H200,
torch 2.11.0+cu130, triton 3.6.0, 2026-11-30 (H 32, H_kv 8, D 128, B 1 and 8, N 32k and 128k,
``flash_decode`` and ``paged_decode``, ``do_bench`` median in turns; data/kv_quant.json), the
fp16 cache's step time over the 8-bit cache's: e4m3 1.08–1.25×, int8 0.86–0.95× (slower). The
loop is bound by converting the tiles, not by their bytes (perf_notes.md, "An 8-bit KV cache in
the decode loop"); ``decode_plan.pick_config`` gives 8-bit caches 256-key tiles.

``TREE=True``: speculative decoding's token tree verified in one step (Miao et al., "SpecInfer:
Accelerating Large Language Model Serving with Tree-based Speculative Inference and
Verification", ASPLOS 2024, section 4.2, https://arxiv.org/abs/2305.09781; FlashInfer's custom
masks, https://docs.flashinfer.ai). The ``N_q`` queries are the tree's nodes, whose keys are the
last ``N_q`` of the sequence's cache in node order (parents first). ``TREE_MASK`` is int64
(B, N_q) with row stride ``stride_tmb`` (0: one tree for the whole batch): bit j of row i is
set iff node i sees node j (itself or an ancestor), so ``N_q <= 64``. A key n >= L_b - N_q holds
node j = n - (L_b - N_q), and row i sees it iff ``(mask_i >> j) & 1`` (and j <= i, the causal
rule); every key before the tree is seen by every row. A chain's mask is the causal mask, bit
for bit. ``ops.decode`` refuses a window or ALiBi with a tree (their distances are a chain's).
A tree costs one int64 load per row and a shift per score; it is not benchmarked on a GPU.

Speed on an NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (N_q 1, H 32, H_kv 8, D 128,
fp16, ``do_bench`` median; data/decode_merge.json, "smoke"), µs, ours (SDPA cuDNN in the same run)
at B 1 N 4k, B 1 N 128k, B 8 N 4k, B 8 N 128k, B 64 N 2k: ``flash_decode`` eagerly 15.0 (17.3),
134.6 (137.2), 47.2 (49.5), 937.4 (941.9), 132.9 (134.3); a planned step as a CUDA graph 15.1
(16.9), 134.7 (136.4), 47.4 (48.5), 937.9 (942.5), 133.7 (134.8). On an NVIDIA H100 80GB HBM3,
torch 2.11.0+cu130, triton 3.6.0, 2026-11-24 (decode.json): paged_decode / flash_decode latency
1.02–1.07× at every shape; a planned step's host time 6 µs (dropin.json). The story: perf_notes.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib._launch import bind as launch
from course_lib.kernels.attention_common import LN2, LOG2E, _tile_mask, cdiv, next_pow2
from course_lib.kernels.band import (
    _band_bounds,
    _head_values,
    _join_sink,
    _key_limits,
    _sink_logit,
    _variant_scores,
    variant_args,
)
from course_lib.kernels.decode_merge import _decode_merge_kernel, _merge_rows
from course_lib.kernels.decode_plan import (  # the plan (split count, config, buffers): here too
    DECODE_CONFIGS,
    INTERLEAVE_MIN_SPLITS,
    INTERLEAVE_MIN_TILES,
    INTERPRET_CONFIG,
    INTERPRET_MAX_SPLITS,
    LOADED_LATENCY_S,
    MAX_SPLITS,
    MERGES,
    MIN_TILES_PER_SPLIT,
    PROGRAMS_PER_SM,
    TWO_STAGE_PROGRAMS_PER_SM,
    SplitPlan,
    _split_range,
    bytes_in_flight,
    capturing,
    choose_num_splits,
    make_plan,
    pick_config,
    split_bounds,
)
from course_lib.masks import Variant

MERGE_CHUNK = 16  # splits merged per step of the merge loop
MERGE_ROWS = tl.constexpr(4)  # rows merged side by side (``_merge_rows``): their loads go together


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, OUT, LSE_OUT,  # these 15 first: what a bound launch takes anew
    stride_kb, stride_kh, stride_kn,  # contiguous: (B, H_kv, N) strides; paged: (block, head, slot)
    stride_vb, stride_vh, stride_vn, N_MAX,
    VARIANT,  # the call's variants (``band.variant_args``; right = 0: the decode is causal)
    K_SCALE, V_SCALE, stride_ksb, stride_ksh, stride_ksn,  # an 8-bit cache's scales (KV_SCALED),
    stride_vsb, stride_vsh, stride_vsn,  # strides as the cache's; then 23 are taken anew
    TREE_MASK, stride_tmb,  # a token tree's bitmasks (TREE): its address the 24th taken anew
    O_PART, LSE_PART, ARRIVED, stride_qb, stride_qh, stride_qm,
    stride_btb,
    stride_ob, stride_oh, stride_om,
    qk_scale, H, NUM_BLOCKS, sm_scale,
    N_Q: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    IEEE_DOT: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, INTERLEAVED: tl.constexpr, WINDOW: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, KV_SCALED: tl.constexpr = False, TREE: tl.constexpr = False,
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
    if WINDOW:  # the splits share the band's keys [lo, seqlen), whole tiles from lo's
        lo, _, _, _ = _band_bounds(0, N_Q, seqlen, VARIANT, N_Q, BLOCK_N)
        first_key, _ = _key_limits(seqlen - N_Q, seqlen, VARIANT)  # of the first query
    else:
        lo = 0
    if INTERLEAVED:  # tiles dealt round-robin: split s owns tiles s, s + S, s + 2S, ...
        step: tl.constexpr = NUM_SPLITS * BLOCK_N
    else:  # split s owns a run of whole BLOCK_N tiles [s·T, (s+1)·T) of this sequence's keys
        step: tl.constexpr = BLOCK_N
    start, end = _split_range(split, lo, seqlen, NUM_SPLITS, BLOCK_N, INTERLEAVED)

    # Rows of this program: r = head_in_group · N_Q + query_index (G·N_Q rows per kv head).
    offs_r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = offs_r < GROUP * N_Q
    head = g * GROUP + offs_r // N_Q  # query head of each row
    qi = offs_r % N_Q  # query token of each row
    # tl.arange needs a power of two: D = 80 runs as 128 columns, the 48 past D masked (0)
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d[None, :] < HEAD_DIM
    # Causal, bottom-right aligned: query i sees keys n <= seqlen - N_Q + i.
    last_key = seqlen - N_Q + qi  # (BLOCK_M,)
    if WINDOW:  # ... and no key before j_lo
        j_lo, _ = _key_limits(last_key, seqlen, VARIANT)
    if TREE:  # ... and of the tree's keys, those whose bit is set in the row's mask
        tree_bits = tl.load(TREE_MASK + b.to(tl.int64) * stride_tmb + qi, mask=row_ok, other=0)

    # Partial results are stored per (b, head, i, split): row id (b·H + head)·N_Q + i.
    part_row = (b * H + head) * N_Q + qi  # (BLOCK_M,)
    lse_ptrs = LSE_PART + part_row * NUM_SPLITS + split
    o_ptrs = O_PART + (part_row * NUM_SPLITS + split)[:, None] * HEAD_DIM + offs_d[None, :]

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
              + qi[:, None] * stride_qm + offs_d[None, :])
    row_mask = _tile_mask(row_ok[:, None], d_ok, PAD_D)
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    head_ok = tl.where(row_ok, head, 0)  # (rows past the group's: head 0, never stored)
    head_values = _head_values(VARIANT, b, head_ok[:, None])  # a column: (ALiBi's slopes)

    if PAGED:
        k_base = K + g * stride_kh
        v_base = V + g * stride_vh
        ks_base, vs_base = K_SCALE + g * stride_ksh, V_SCALE + g * stride_vsh
        bt_base = BLOCK_TABLE + b.to(tl.int64) * stride_btb
    else:
        k_base = K + b.to(tl.int64) * stride_kb + g * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + g * stride_vh
        ks_base = K_SCALE + b.to(tl.int64) * stride_ksb + g * stride_ksh
        vs_base = V_SCALE + b.to(tl.int64) * stride_vsb + g * stride_vsh

    for start_n in range(start, end, step):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical key positions
        n_ok = offs_n < end
        if WINDOW:  # no key before the band is loaded, not even in its first tile
            n_ok = n_ok & (offs_n >= first_key)
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
        kv_mask = _tile_mask(n_ok[:, None], d_ok, PAD_D)
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_SCALED:  # 8-bit values are exact in q's dtype; each key's scale, outside the dots
            if PAGED:  # the same (block, slot) as the token's K and V
                ks_rows = block * stride_ksb + slot * stride_ksn  # (BLOCK_N,)
                vs_rows = block * stride_vsb + slot * stride_vsn
            else:
                ks_rows = offs_n.to(tl.int64) * stride_ksn
                vs_rows = offs_n.to(tl.int64) * stride_vsn
            k_scale = tl.load(ks_base + ks_rows, mask=n_ok, other=0.0)  # (BLOCK_N,)
            v_scale = tl.load(vs_base + vs_rows, mask=n_ok, other=0.0)
            k, v = k.to(q.dtype), v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE_DOT else None)
        if KV_SCALED:
            s = s * k_scale[None, :]  # q · (k̂ · k_scale) per key
        s = _variant_scores(s, last_key, offs_n, sm_scale, VARIANT, head_values)[0]  # the cap
        # and the ALiBi bias, if any (in q·k's units)
        s = s * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        visible = offs_n[None, :] <= last_key[:, None]  # causal and in range (n < seqlen)
        if WINDOW:  # and no further back than the window's left side
            visible = visible & (offs_n[None, :] >= j_lo[:, None])
        if TREE:  # key n holds node j = n - (L_b - N_q); j < 0: the cache before the tree
            node = offs_n - (seqlen - N_Q)  # (BLOCK_N,)
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(node, 0), N_Q - 1)[None, :]) & 1
            visible = visible & ((node[None, :] < 0) | (bit != 0))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_SCALED:
            p = p * v_scale[None, :]  # Σ_n p_n · v_scale_n · v̂_n: the scale rides on P's column
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision="ieee" if IEEE_DOT else None)
        m_i = m_new

    if NUM_SPLITS == 1:  # with sinks, e^{sink} joins the denominator, with no value
        acc, m_i, l_i = _join_sink(acc, m_i, l_i, VARIANT, head_ok)
    # A split with no visible key (past a short sequence's end, or before a causal row's first
    # key) has l = 0: it stores lse = -inf and o = 0, and weighs nothing in the merge.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    if NUM_SPLITS == 1:  # the only split: its result is the answer, no merge
        out_ptrs = (OUT + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh
                    + qi[:, None] * stride_om + offs_d[None, :])
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_mask)
        tl.store(LSE_OUT + part_row, lse, mask=row_ok)
    else:
        tl.store(lse_ptrs, lse, mask=row_ok)
        tl.store(o_ptrs, o, mask=row_mask)
        if FUSED_MERGE:
            # The last split of these rows to finish merges them: stores done (barrier), one
            # release-acquire atomic counts this split in; the last sees every split's stores.
            tl.debug_barrier()
            counter = ARRIVED + bg * tl.num_programs(2) + m_tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                rows_end = tl.minimum(m_tile * BLOCK_M + BLOCK_M, GROUP * N_Q)
                for r0 in range(m_tile * BLOCK_M, rows_end, MERGE_ROWS):  # rows side by side
                    r = r0 + tl.arange(0, MERGE_ROWS)
                    r_ok = r < rows_end
                    head_r, qi_r = g * GROUP + r // N_Q, r % N_Q
                    _merge_rows(O_PART, LSE_PART, (b * H + head_r) * N_Q + qi_r, r_ok,
                                OUT + b.to(tl.int64) * stride_ob + head_r[:, None] * stride_oh
                                + qi_r[:, None] * stride_om + offs_d[None, :], LSE_OUT,
                                _sink_logit(VARIANT, tl.where(r_ok, head_r, 0)), MERGE_ROWS,
                                NUM_SPLITS, BLOCK_S, HEAD_DIM, CHUNK, HAS_SINKS)


# A bound launch of the split kernel (course_lib._launch.bind) takes its first 15 arguments anew:
# the addresses of q, k, v, seqlens, block_table, out, lse, the cache's 6 strides, N_MAX and
# VARIANT, its tensors as addresses (``variant_addresses``); with an 8-bit cache 8 more: the
# addresses of its scales and their 6 strides (``cache_geometry`` of the scales); with a token
# tree those 8 (in place of absent scales: q's address twice and six 0s) and TREE_FREE more, the
# address of its bitmasks.
SPLIT_FREE = 15
SCALE_FREE = 8
TREE_FREE = 1


def variant_addresses(variant: Variant) -> tuple:
    """(VARIANT with each tensor as its address, whether every such address is 16-byte
    aligned): what a bound split launch takes for VARIANT."""
    values = variant_args(variant)[0]
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in values)
    return addresses, all(not a & 15 for a, t in zip(addresses, values)
                          if isinstance(t, torch.Tensor))


def cache_geometry(paged: bool, k, v) -> tuple:
    """The split kernel's stride arguments of k and v: (batch or block, head, key) strides; of
    their scales too, laid out as the cache without D."""
    sk, sv = k.stride(), v.stride()
    if paged:  # (num_blocks, block_size, H_kv, D): block, slot, head strides
        return sk[0], sk[2], sk[1], sv[0], sv[2], sv[1]
    return sk[0], sk[1], sk[2], sv[0], sv[1], sv[2]  # (B, H_kv, N, D)


def run_plan(plan: SplitPlan, q, k, v, seqlens, block_table, sm_scale: float, out, lse,
             bind: bool = False, n_max: int | None = None, variant: Variant | None = None,
             kv_scales: tuple | None = None, tree_bits: torch.Tensor | None = None):
    """A decode step into ``out`` (B, H, N_q, D) and ``lse`` (B, H, N_q): one launch (one split,
    or the fused merge) or two (then the merge kernel). ``k``, ``v``: (B, H_kv, N, D), or pages
    (num_blocks, block_size, H_kv, D) with ``block_table``; ``seqlens`` (B,) int32 or None.
    ``bind=True`` returns the launches bound to all but ``SPLIT_FREE`` (or None): call the first
    as ``launch(*addresses, *cache_geometry(paged, k, v), n_max, variant_addresses(variant)[0])``
    (with ``kv_scales``, ``SCALE_FREE`` more: their addresses, then ``cache_geometry`` of them;
    with ``tree_bits``, those and ``TREE_FREE`` more: its address).
    ``n_max``: the cache's length where it is shorter than the plan's (a plan serves a range of
    lengths). ``variant``: checked, with the plan's window, its tensors contiguous (None: plain
    causal attention). ``kv_scales``: (k_scale, v_scale) fp32 of an 8-bit k, v, shaped as them
    without D (None: a cache in q's dtype). ``tree_bits``: a token tree's int64 bitmasks, (N_q,)
    for the whole batch or (B, N_q), contiguous (None: the queries causal among themselves)."""
    variant = variant or Variant(plan.window)
    sinks = variant.sinks
    sq, so = q.stride(), out.stride()
    stride_bt = block_table.stride(0) if plan.paged else 0
    cfg, B, H, N_q, D, S = plan.config, plan.B, plan.H, plan.N_q, plan.D, plan.num_splits
    has_seqlens = seqlens is not None
    fused = plan.merge == "fused"  # (``make_plan`` has turned "auto" into one of MERGES)
    block_s = next_pow2(S)
    chunk = min(MERGE_CHUNK, block_s)  # one chunking for both merges: the same sums
    # One split never touches the scratch buffers (NUM_SPLITS == 1 is a compiled variant of its
    # own): lse stands in for them, so a plan of one split holds no tensor at all.
    o_part, lse_part, arrived = ((lse, lse, lse) if S == 1 else
                                 (plan.o_part, plan.lse_part, plan.arrived))
    n_max = plan.n_max if n_max is None else n_max
    scaled = kv_scales is not None
    scales = (*kv_scales, *cache_geometry(plan.paged, *kv_scales)) if scaled else (q, q, *[0] * 6)
    tree = tree_bits is not None
    tree_args = (tree_bits, tree_bits.stride(0) if tree_bits.dim() == 2 else 0) if tree else (q, 0)
    free = SPLIT_FREE + SCALE_FREE * (scaled or tree) + TREE_FREE * tree
    split = launch(free if bind else None, _decode_split_kernel,
                   (S, B * plan.H_kv, plan.m_tiles),
                   q, k, v, seqlens if has_seqlens else q, block_table if plan.paged else q,
                   out, lse, *cache_geometry(plan.paged, k, v), n_max, variant_args(variant)[0],
                   *scales, *tree_args, o_part, lse_part, arrived, sq[0], sq[1], sq[2],
                   stride_bt, so[0], so[1], so[2], sm_scale * LOG2E.value, H, plan.num_blocks,
                   float(sm_scale), N_Q=N_q, GROUP=H // plan.H_kv, NUM_SPLITS=S, HEAD_DIM=D,
                   BLOCK_M=plan.block_m, BLOCK_N=cfg["BLOCK_N"], PAGED=plan.paged,
                   PAGE_SIZE=plan.page_size, HAS_SEQLENS=has_seqlens,
                   IEEE_DOT=q.dtype == torch.float32, FUSED_MERGE=fused, BLOCK_S=block_s,
                   CHUNK=chunk, INTERLEAVED=plan.interleaved, WINDOW=variant.window[0] >= 0,
                   HAS_SINKS=sinks is not None, KV_SCALED=scaled, TREE=tree,
                   num_warps=cfg["num_warps"],
                   num_stages=cfg["num_stages"])
    launches = [split]
    if S > 1 and not fused:
        merge = launch(0 if bind else None, _decode_merge_kernel,
                       (cdiv(B * H * N_q, MERGE_ROWS.value),),
                       plan.o_part, plan.lse_part, out, lse, lse if sinks is None else sinks,
                       H, B * H * N_q, so[0], so[1], so[2], N_Q=N_q, NUM_SPLITS=S,
                       BLOCK_S=block_s, HEAD_DIM=D, CHUNK=chunk, ROWS=MERGE_ROWS,
                       HAS_SINK=sinks is not None,  # the fused merge's warps at D 128: the
                       num_warps=max(4, cfg["num_warps"]) if D >= 128 else 2)  # same sums
        launches.append(merge)
    if bind:
        return None if any(f is None for f in launches) else launches
    return out, lse


__all__ = [  # the kernel's launch, and decode_plan's names, which the lessons import from here
    "DECODE_CONFIGS", "INTERLEAVE_MIN_SPLITS", "INTERLEAVE_MIN_TILES", "INTERPRET_CONFIG",
    "INTERPRET_MAX_SPLITS", "LOADED_LATENCY_S", "MAX_SPLITS", "MERGES", "MERGE_CHUNK",
    "MERGE_ROWS", "MIN_TILES_PER_SPLIT", "PROGRAMS_PER_SM", "SCALE_FREE", "SPLIT_FREE",
    "TREE_FREE", "TWO_STAGE_PROGRAMS_PER_SM", "SplitPlan", "bytes_in_flight", "cache_geometry",
    "capturing", "choose_num_splits", "make_plan", "pick_config", "run_plan", "split_bounds",
    "variant_addresses",
]
