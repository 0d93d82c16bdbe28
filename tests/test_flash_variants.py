"""The variants' forward kernels (kernels.flash_variants, the portable one, and
kernels.flash_variants_hopper, the TMA one) against reference.attention_variants: the 2x rule,
odd lengths, N_q != N_k, GQA, padded head dims, poisoned outputs."""
import itertools

import pytest
import torch
import triton
import triton.language as tl

from course_lib import masks
from course_lib.kernels.flash_variants import _band_bounds, forward_variants, variant_args
from course_lib.kernels.flash_variants_hopper import forward_variants_hopper
from course_lib.masks import Variant
from course_lib.reference import attention_variants
from course_lib.testing import (
    KERNEL_DTYPES,
    assert_close_2x,
    fresh_randn,
    poison_,
    variants_same_precision,
)

SHAPES = [  # B, H, H_kv, N_q, N_k, D
    (1, 2, 2, 1, 1, 32),
    (1, 4, 2, 37, 37, 64),
    (2, 2, 1, 17, 70, 32),   # a chunk of new queries against a longer cache
    (1, 2, 1, 70, 23, 16),   # N_q > N_k: with causal or a window, rows that see no key
    (1, 2, 2, 45, 45, 40),   # a head dim that is not a power of two
]
VARIANTS = {  # name: (causal, window_size, softcap, alibi, sinks)
    "window": (False, (8, 3), 0.0, False, False),
    "window causal": (True, (12, -1), 0.0, False, False),
    "window right only": (False, (-1, 5), 0.0, False, False),
    "causal": (True, (-1, -1), 0.0, False, False),
    "softcap": (False, (-1, -1), 3.0, False, False),
    "alibi": (False, (-1, -1), 0.0, True, False),
    "alibi per batch": (True, (-1, -1), 0.0, "batch", False),
    "sinks": (False, (-1, -1), 0.0, False, True),
    "sinks causal": (True, (-1, -1), 0.0, False, True),
    "gemma 2 (softcap, window, causal)": (True, (16, -1), 5.0, False, False),
    "gpt-oss (sinks, window, causal)": (True, (9, -1), 0.0, False, True),
    "everything": (True, (20, -1), 4.0, True, True),
    "wide window causal": (True, (60, -1), 0.0, False, False),  # blocks every row sees in full
}
FORWARDS = {"portable": forward_variants, "hopper": forward_variants_hopper}


def _skip_unless_tma(impl, D):
    if impl == "hopper" and (D & (D - 1) or D < 16):
        pytest.skip("the TMA kernel takes power-of-two head dims from 16 on")


def _extras(name, B, H, device):
    causal, window, softcap, alibi, sinks = VARIANTS[name]
    g = torch.Generator().manual_seed(len(name))
    slopes = None
    if alibi:
        slopes = (torch.rand((B, H) if alibi == "batch" else (H,), generator=g) * 0.5).to(device)
    sink = (torch.randn(H, generator=g) * 2).to(device) if sinks else None
    return causal, window, softcap, slopes, sink


def _run(q, k, v, name, sm_scale=None, impl="portable"):
    B, H, N_q, D = q.shape
    causal, window, softcap, slopes, sink = _extras(name, B, H, q.device)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    out = (poison_(torch.empty_like(q)), poison_(torch.empty(B, H, N_q, device=q.device)))
    variant = Variant(masks.normalize_window(window, causal), softcap, slopes, sink)
    o, lse = FORWARDS[impl](q, k, v, sm_scale, variant, out=out)
    kw = dict(causal=causal, sm_scale=sm_scale, window_size=window, softcap=softcap,
              alibi_slopes=slopes, sinks=sink)
    ref_o, ref_lse = attention_variants(q, k, v, return_lse=True, **kw)
    return o, lse, ref_o, ref_lse, variants_same_precision(q, k, v, **kw)


@pytest.mark.parametrize("impl", list(FORWARDS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_the_reference(shape, name, dtype, impl):
    B, H, H_kv, N_q, N_k, D = shape
    _skip_unless_tma(impl, D)
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    v = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    o, lse, ref_o, ref_lse, same = _run(q, k, v, name, impl=impl)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "an element never written"
    assert_close_2x(o, ref_o, same, name=f"O {name}")
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen), "rows that see no key: lse -inf, and only them"
    assert_close_2x(lse[seen], ref_lse[seen], ref_lse[seen], name=f"lse {name}", atol=1e-4)


@pytest.mark.parametrize("impl", list(FORWARDS))
@pytest.mark.parametrize("window", [(-1, -1), (6, 2), (0, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_combination_of_the_variants(causal, window, impl):
    """window x causal x softcap x ALiBi x sinks x GQA, one odd shape each, in the first kernel
    dtype: fp32 in the interpreter, fp16 on a GPU (each combination is a kernel of its own
    there, and an fp32 one compiles its dots to scalar FMAs, several times slower; split by
    causal and window, the compiles spread over the workers). The 2x rule against fp64."""
    B, H, H_kv, N_q, N_k, D = 1, 4, 2, 29, 41, 32
    dtype = KERNEL_DTYPES[0]
    q, k, v = (fresh_randn(B, h, n, D, dtype=dtype)
               for h, n in ((H, N_q), (H_kv, N_k), (H_kv, N_k)))
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(H, generator=g).to(q.device)
    sinks = torch.randn(H, generator=g).to(q.device)
    for softcap, alibi, sink in itertools.product((0.0, 2.5), (None, slopes), (None, sinks)):
        w = masks.normalize_window(window, causal)
        o, lse = FORWARDS[impl](q, k, v, 0.2, Variant(w, softcap, alibi, sink))
        kw = dict(causal=causal, sm_scale=0.2, window_size=window, softcap=softcap,
                  alibi_slopes=alibi, sinks=sink)
        ref_o, ref_lse = attention_variants(*(t.double() for t in (q, k, v)), return_lse=True,
                                            **kw)
        label = f"softcap={softcap} alibi={alibi is not None} sinks={sink is not None}"
        assert_close_2x(o, ref_o, variants_same_precision(q, k, v, **kw), name=f"O {label}",
                        atol=2e-5, verbose=False)
        seen = ~torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), ~seen), f"{label}: lse -inf for the unseen rows only"
        torch.testing.assert_close(lse[seen], ref_lse[seen].float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", list(FORWARDS))
def test_a_window_skips_the_blocks_outside_the_band(impl):
    """Keys outside every row's band are never read: poison them with NaN, the answer stays.
    (A masked key that was read would still turn its row NaN: 0 · NaN in P·V.)"""
    B, H, N, D = 1, 2, 512, 16
    q, k, v = (fresh_randn(B, H, N, D) for _ in range(3))
    window = (10, 0)
    o_ref = attention_variants(q, k, v, window_size=window)
    # rows 384..511 (a whole query block in the interpreter's 32-row blocks and the GPU's 64- or
    # 128-row ones) see keys from 374 on: the key blocks of 0..255 are outside their band
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :256], v2[:, :, :256] = float("nan"), float("nan")
    o, _ = FORWARDS[impl](q, k2, v2, D ** -0.5, Variant(window))
    torch.testing.assert_close(o[:, :, 384:], o_ref[:, :, 384:], atol=1e-5, rtol=1e-5)


def test_auto_takes_the_tma_kernel_only_for_measured_head_dims(monkeypatch):
    """impl=None follows best_impl for D 128 (its config was measured with the variants) and
    runs the portable kernel for other head dims."""
    from course_lib.kernels.flash_variants_hopper import MEASURED_HEAD_DIMS
    from course_lib.ops import attention as ov

    ran = []
    monkeypatch.setattr(ov, "best_impl", lambda q, k, v: "hopper")
    for impl in ("portable", "hopper"):
        monkeypatch.setitem(ov._VARIANT_FORWARDS, impl,
                            lambda q, *rest, impl=impl, **kw: ran.append((impl, q.shape[-1])))
    for D in (64, 128, 256):
        q = torch.empty(1, 1, 4, D)
        ov._variants_forward(q, q, q, 0.1, Variant((8, 0)), "auto")
    assert MEASURED_HEAD_DIMS == (128,)
    assert ran == [("portable", 64), ("hopper", 128), ("portable", 256)]


@pytest.mark.parametrize("window", [(70, 0), (-1, 0)])
def test_the_pinned_max_runs_again_when_a_later_score_overflows(window):
    """The TMA kernel pins each row's max after the full key block nearest the diagonal and the
    band's right edge. Keys far from the diagonal with scores 2^20 times larger make fp16's P
    overflow: the program must notice and run again with the running max, and give the
    reference's answer."""
    B, H, N, D = 1, 2, 96, 64
    q, k, v = (fresh_randn(B, H, N, D, dtype=torch.float16) for _ in range(3))
    # keys 0..39 score about 4·30/8 = 15 (natural) above the rest: P up to 2^21 > fp16's 65504
    q[..., 0], k[:, :, :40, 0] = 4.0, 30.0
    o, lse = forward_variants_hopper(q, k, v, D ** -0.5, Variant(window))
    ref_o, ref_lse = attention_variants(q, k, v, sm_scale=D ** -0.5, window_size=window,
                                        return_lse=True)
    same = variants_same_precision(q, k, v, sm_scale=D ** -0.5, window_size=window)
    assert torch.isfinite(o).all()
    assert_close_2x(o, ref_o, same, name="O after the rerun")
    assert_close_2x(lse, ref_lse, ref_lse, name="lse after the rerun", atol=1e-4)


@pytest.mark.parametrize("name", ["causal", "window", "everything", "alibi per batch"])
def test_varlen_packed_sequences_match_the_reference(name):
    """Sequences of lengths 0 to 70 packed in one tensor, each aligned on its own."""
    from course_lib.kernels.flash_variants import forward_variants_varlen
    from course_lib.reference import attention_varlen

    lens_q, lens_k = [5, 0, 37, 1, 70, 16], [9, 3, 37, 20, 33, 16]
    H, H_kv, D = 4, 2, 32
    dev = fresh_randn(1).device
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=dev)
    q = fresh_randn(sum(lens_q), H, D)
    k, v = fresh_randn(sum(lens_k), H_kv, D), fresh_randn(sum(lens_k), H_kv, D)
    causal, window, softcap, slopes, sink = _extras(name, len(lens_q), H, dev)
    w = masks.normalize_window(window, causal)
    out = (poison_(torch.empty_like(q)), poison_(torch.empty(H, sum(lens_q), device=dev)))
    o, lse = forward_variants_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.25,
                                     Variant(w, softcap, slopes, sink), out=out)
    ref_o, ref_lse = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal,
                                      0.25, return_lse=True, window_size=window, softcap=softcap,
                                      alibi_slopes=slopes, sinks=sink)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "an element never written"
    torch.testing.assert_close(o, ref_o.to(o.dtype), atol=3e-5, rtol=3e-5)
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=3e-5, rtol=3e-5)


def _paged(k, lens_k, page_size, num_blocks, generator):
    """Packed k (total_k, H_kv, D) as pages (num_blocks, page_size, H_kv, D) in a random order,
    and the block table (B, max_blocks) int32 (unused entries -1)."""
    max_blocks = max(-(-n // page_size) for n in lens_k)
    pages = fresh_randn(num_blocks, page_size, *k.shape[1:])  # other sequences' keys around
    table = torch.full((len(lens_k), max(max_blocks, 1)), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    start = 0
    for b, n in enumerate(lens_k):
        for j in range(-(-n // page_size)):
            page = free.pop()
            table[b, j] = page
            rows = k[start + j * page_size: start + min(n, (j + 1) * page_size)]
            pages[page, :len(rows)] = rows
        start += n
    return pages, table.to(k.device)


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("name", ["causal", "window", "everything"])
def test_varlen_over_a_paged_cache_matches_the_packed_keys(name, page_size):
    """A serving step: chunks of new queries (a prefill chunk, single decode tokens, none)
    against each sequence's whole cache in pages, through ``flash_attn_varlen(block_table=)``:
    the same result as the packed keys, with poisoned pages around them."""
    from course_lib.ops import flash_attn_varlen
    from course_lib.reference import attention_varlen

    lens_q, lens_k = [5, 0, 1, 1, 33, 16], [9, 3, 37, 20, 33, 70]
    H, H_kv, D = 4, 2, 32
    dev = fresh_randn(1).device
    g = torch.Generator().manual_seed(page_size)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=dev)
    q = fresh_randn(sum(lens_q), H, D)
    k, v = fresh_randn(sum(lens_k), H_kv, D), fresh_randn(sum(lens_k), H_kv, D)
    k_pages, table = _paged(k, lens_k, page_size, 40, g)
    v_pages, _ = _paged(v, lens_k, page_size, 40, torch.Generator().manual_seed(page_size))
    causal, window, softcap, slopes, sink = _extras(name, len(lens_q), H, dev)
    o, lse = flash_attn_varlen(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                               causal, 0.25, window_size=window, softcap=softcap,
                               alibi_slopes=slopes, sinks=sink, return_lse=True,
                               block_table=table)
    ref_o, ref_lse = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal,
                                      0.25, return_lse=True, window_size=window, softcap=softcap,
                                      alibi_slopes=slopes, sinks=sink)
    torch.testing.assert_close(o, ref_o.to(o.dtype), atol=3e-5, rtol=3e-5)
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=3e-5, rtol=3e-5)


def test_varlen_over_pages_names_a_bad_argument():
    from course_lib.ops import flash_attn_varlen

    dev = fresh_randn(1).device
    q, pages = fresh_randn(3, 2, 16), fresh_randn(4, 8, 1, 16)
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 5, 17], dtype=torch.int32, device=dev)
    table = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32, device=dev)
    flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 12, True, block_table=table)
    bad = torch.tensor([[0, -1], [1, 9]], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9"):  # values: validate=True
        flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 12, True, block_table=bad,
                          validate=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_k gives key counts in \[10, 24\]"):
        flash_attn_varlen(q, pages, pages, cu_q, cu_k.mul(2), 2, 24, True, block_table=table,
                          validate=True)
    with pytest.raises(ValueError, match="max_seqlen_k = 10"):
        flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 10, True, block_table=table,
                          validate=True)
    with pytest.raises(TypeError, match="block_table must be int32"):
        flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 12, True, block_table=table.long())
    with pytest.raises(ValueError, match="k must be pages"):
        flash_attn_varlen(q, fresh_randn(8, 4, 1, 16).transpose(0, 1), pages, cu_q, cu_k, 2,
                          12, True, block_table=table)
    # values nothing checked (validate=False): clamped into the table and the pool, no read
    # outside them; a block id past the pool reads its last page
    o = flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 12, True, block_table=bad,
                          validate=False)
    ref = flash_attn_varlen(q, pages, pages, cu_q, cu_k, 2, 12, True, block_table=torch.tensor(
        [[0, -1], [1, 3]], dtype=torch.int32, device=dev))
    torch.testing.assert_close(o, ref)
    long_k = torch.tensor([0, 5, 40], dtype=torch.int32, device=dev)  # past the table's 16
    assert torch.isfinite(flash_attn_varlen(q, pages, pages, cu_q, long_k, 2, 40, True,
                                            block_table=table, validate=False)).all()
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_varlen(q.requires_grad_(), pages, pages, cu_q, cu_k, 2, 12, True,
                          block_table=table)


@triton.jit
def _bounds_probe(OUT, N_Q, N_K, VARIANT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = _band_bounds(pid * BLOCK_M, N_Q, N_K, VARIANT, BLOCK_M, BLOCK_N)
    tl.store(OUT + pid * 4 + 0, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


@pytest.mark.parametrize("n_q,n_k", [(64, 64), (37, 100), (100, 37), (1, 50)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (10, 0), (5, 7), (0, 0), (-1, 20)])
def test_the_kernel_visits_exactly_the_blocks_the_rule_names(n_q, n_k, window):
    """``_band_bounds`` (the kernel's) against ``masks.block_kind`` (the lesson's): the blocks
    its loops visit are the blocks that are not skipped, and it runs unmasked exactly the
    blocks every row sees in full."""
    bm, bn = 16, 8
    m_blocks = triton.cdiv(n_q, bm)
    out = torch.full((m_blocks * 4,), -7, dtype=torch.int32, device=fresh_randn(1).device)
    _bounds_probe[(m_blocks,)](out, n_q, n_k, variant_args(Variant(window))[0], BLOCK_M=bm,
                               BLOCK_N=bn)
    got = out.view(m_blocks, 4).tolist()
    for pid, (lo, full_lo, full_hi, hi) in enumerate(got):
        r0, r1 = pid * bm, min(pid * bm + bm, n_q)
        masked = set(range(lo, full_lo, bn)) | set(range(full_hi, hi, bn))
        unmasked = set(range(full_lo, full_hi, bn))
        kinds = {c0: masks.block_kind(r0, r1, c0, c0 + bn, n_q, n_k, window)
                 for c0 in range(0, n_k, bn)}
        assert masked.isdisjoint(unmasked)
        assert masked | unmasked == {c for c, kind in kinds.items() if kind != "skipped"}
        assert unmasked == {c for c, kind in kinds.items() if kind == "unmasked"}
