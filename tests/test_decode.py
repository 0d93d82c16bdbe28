"""flash_decode and paged_decode (split-KV, LSE merge, GQA, paging) against the fp32 reference."""
import math

import pytest
import torch

import course_lib
from course_lib.bench.decode import TUNE_CONFIGS
from course_lib.kernels import decode as dec
from course_lib.kvcache import contiguous_to_pages, pages_to_contiguous
from course_lib.ops import decode as opd
from course_lib.ops import flash_decode, paged_decode
from course_lib.reference import decode_reference
from course_lib.testing import (
    KERNEL_DTYPES,
    assert_close_2x,
    attention_same_precision,
    fresh_randn,
    poison_,
    reads_back,
)

DTYPES = KERNEL_DTYPES

CASES = [  # B, H, H_kv, N_q, N_max, D, lengths (None: all N_max)
    (1, 2, 2, 1, 1, 32, None),                 # a single key
    (2, 4, 4, 1, 37, 32, [37, 5]),             # MHA, lengths not a multiple of the tile
    (3, 8, 2, 1, 100, 64, [100, 17, 1]),       # GQA group of 4, ragged lengths
    (2, 4, 1, 1, 70, 16, [33, 70]),            # MQA
    (2, 8, 2, 3, 97, 64, [97, 40]),            # speculative verification: 3 causal queries
    (2, 4, 2, 4, 50, 32, [2, 50]),             # N_q > L_b: the first rows see no key
    (1, 4, 2, 2, 256, 128, [211]),             # the course's real head dim
    (2, 2, 2, 1, 40, 32, [0, 40]),             # an empty sequence: o = 0, lse = -inf
]


def _case_id(c):
    return "B{}H{}kv{}q{}N{}D{}".format(*c[:6])


def _inputs(B, H, H_kv, N_q, N_max, D, lengths, dtype):
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k = fresh_randn(B, H_kv, N_max, D, dtype=dtype)
    v = fresh_randn(B, H_kv, N_max, D, dtype=dtype)
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=q.device)
    return q, k, v, lens


def _same_precision(q, k, v, lens):
    """PyTorch in the inputs' dtype, per sequence on its first L_b keys (the 2x rule's baseline)."""
    n = [k.shape[2]] * q.shape[0] if lens is None else lens.tolist()
    return torch.cat([attention_same_precision(q[b:b + 1], k[b:b + 1, :, :n[b]],
                                               v[b:b + 1, :, :n[b]], causal=True)
                      for b in range(q.shape[0])])


def _poison_kernel_outputs(monkeypatch, seen=None):
    """Make every floating-point buffer ``torch.empty`` and ``torch.empty_like`` allocate
    (partials, output, lse) start as NaN; ``seen``: a list that gets every tensor allocated."""
    def poisoned(allocate):
        def empty(*args, **kwargs):
            t = allocate(*args, **kwargs)
            if seen is not None:
                seen.append(t)
            return poison_(t) if t.is_floating_point() else t
        return empty

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    opd.forget_plans()  # no reused split buffers


def _check(o, lse, q, k, v, lens, name):
    ref_o, ref_lse = decode_reference(q.float(), k.float(), v.float(), lens, return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any(), f"{name}: an output element was never written (or is NaN)"
    assert not torch.isnan(lse).any(), f"{name}: an lse element was never written (or is NaN)"
    assert_close_2x(o, ref_o, _same_precision(q, k, v, lens), name=f"{name} O")
    assert_close_2x(lse, ref_lse, ref_lse, name=f"{name} lse", atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_decode_matches_reference(case, dtype, monkeypatch):
    q, k, v, lens = _inputs(*case, dtype)
    _poison_kernel_outputs(monkeypatch)
    o, lse = flash_decode(q, k, v, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, "flash_decode")


def test_a_growing_cache_keeps_its_plan(monkeypatch):
    """transformers' DynamicCache grows by one token per step: one plan serves a range of
    lengths (the kernel is told the true one), and every step still matches the reference."""
    B, H, H_kv, D = 1, 4, 2, 32
    k_all, v_all = fresh_randn(B, H_kv, 150, D), fresh_randn(B, H_kv, 150, D)
    seen = []
    _poison_kernel_outputs(monkeypatch, seen)
    for n in (129, 130, 141, 149):  # one bucket: up to 192 keys
        q = fresh_randn(B, H, 1, D)
        k, v = k_all[:, :, :n].contiguous(), v_all[:, :, :n].contiguous()
        o, lse = flash_decode(q, k, v, num_splits=2, return_lse=True)
        _check(o, lse, q, k, v, None, f"{n} keys")
    allocated = [tuple(t.shape) for t in seen]
    assert allocated.count((B, H, 1, 2, D)) == 1, "a plan's split buffers were made again"
    assert [opd._length_bucket(n) for n in (1, 64, 65, 2048, 2049, 2304, 2305)] == [
        64, 64, 128, 2048, 2304, 2304, 2560]


def test_an_lse_not_returned_goes_to_the_plans_buffer(monkeypatch):
    """Without ``return_lse`` an eager call allocates only its output: the lse it must write
    goes to a buffer of the plan. With it, the lse is a new tensor every call."""
    B, H, H_kv, D, n = 2, 4, 2, 32, 37
    k, v = fresh_randn(B, H_kv, n, D), fresh_randn(B, H_kv, n, D)
    seen = []
    _poison_kernel_outputs(monkeypatch, seen)
    for num_splits in (1, 3):
        for step in range(2):
            q = fresh_randn(B, H, 1, D)
            seen.clear()
            o = flash_decode(q, k, v, num_splits=num_splits)
            # the output every call; an lse-shaped buffer only once, for the plan
            allocated = [tuple(t.shape) for t in seen if not t.is_meta]  # (meta: no memory)
            assert allocated.count((B, H, 1, D)) == 1
            assert allocated.count((B, H, 1)) == (step == 0), allocated
            seen.clear()
            o2, lse = flash_decode(q, k, v, num_splits=num_splits, return_lse=True)
            assert [tuple(t.shape) for t in seen] == [(B, H, 1, D), (B, H, 1)]
            _check(o2, lse, q, k, v, None, f"{num_splits} splits")
            assert torch.equal(o, o2)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_decode_matches_reference(case, dtype, block_size, monkeypatch):
    q, k, v, lens = _inputs(*case, dtype)
    if lens is None:
        lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    gen = torch.Generator().manual_seed(7)
    k_pages, table = contiguous_to_pages(k, block_size=block_size, num_blocks=None,
                                         generator=gen)
    gen = torch.Generator().manual_seed(7)
    v_pages, table_v = contiguous_to_pages(v, block_size=block_size, generator=gen)
    assert torch.equal(table, table_v)
    _poison_kernel_outputs(monkeypatch)
    o, lse = paged_decode(q, k_pages, v_pages, table, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, "paged_decode")


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_any_number_of_splits_gives_the_same_answer(num_splits):
    q, k, v, lens = _inputs(2, 4, 2, 2, 130, 32, [130, 45], torch.float32)
    o, lse = flash_decode(q, k, v, lens, num_splits=num_splits, return_lse=True)
    _check(o, lse, q, k, v, lens, f"{num_splits} splits")


@pytest.mark.parametrize("merge", dec.MERGES)
@pytest.mark.parametrize("case", [  # B, H, H_kv, N_q, N_max, D, lengths, splits
    (2, 8, 2, 3, 97, 64, [97, 40], 3),   # 12 rows in one tile; b = 1 leaves split 2 empty
    (1, 48, 1, 3, 70, 32, [70], 4),      # 144 rows: three row tiles, each merged on its own
    (2, 4, 2, 1, 50, 32, [50, 3], 1),    # one split: the split kernel writes the answer
], ids=["one_tile", "three_tiles", "one_split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_merges_step_after_step(case, merge, dtype, monkeypatch):
    """Fused into the split kernel or by a second kernel, the merge gives the reference's
    answer at every step of one plan: the fused merge's arrival counters go back to 0."""
    *shape, lengths, splits = case
    B, H, H_kv, N_q, N_max, D = shape
    _, k, v, lens = _inputs(*shape, lengths, dtype)
    _poison_kernel_outputs(monkeypatch)
    plan = dec.make_plan(B, H, H_kv, N_q, D, N_max, k.device, num_splits=splits, merge=merge)
    for step in range(3):
        q = fresh_randn(B, H, N_q, D, dtype=dtype)
        out = poison_(torch.empty(B, H, N_q, D, device=q.device, dtype=dtype))
        lse = poison_(torch.empty(B, H, N_q, device=q.device))
        dec.run_plan(plan, q, k, v, lens, None, D ** -0.5, out, lse)
        _check(out, lse, q, k, v, lens, f"merge={merge} step {step}")
        if merge == "fused" and splits > 1:  # one split has no counters (a placeholder)
            assert not plan.arrived.any(), "an arrival counter was not reset to 0"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_interleaved_splits_deal_the_tiles_round_robin(paged, monkeypatch):
    """A plan with ``interleaved``: split s holds the lse of tiles s, s + S, s + 2S, ... of each
    sequence (the last one cut at L_b), and the merged answer is the reference's; ragged
    lengths, GQA, two causal queries, contiguous and paged."""
    B, H, H_kv, N_q, N_max, D, lengths, S = 2, 4, 2, 2, 150, 32, [150, 37], 3
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, lengths, torch.float32)
    _poison_kernel_outputs(monkeypatch)
    caches, table, extra = (k, v), None, {}
    if paged:
        k_pages, table = contiguous_to_pages(k, generator=torch.Generator().manual_seed(3))
        v_pages, _ = contiguous_to_pages(v, generator=torch.Generator().manual_seed(3))
        caches, extra = (k_pages, v_pages), dict(paged=True, page_size=16,
                                                 num_blocks=k_pages.shape[0])
    plan = dec.make_plan(B, H, H_kv, N_q, D, table.shape[1] * 16 if paged else N_max, q.device,
                         num_splits=S, merge="kernel", interleaved=True, **extra)
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(B, H, N_q, device=q.device))
    dec.run_plan(plan, q, *caches, lens, table, D ** -0.5, out, lse)
    _check(out, lse, q, k, v, lens, "interleaved")
    block_n = plan.config["BLOCK_N"]
    kr = k.float().repeat_interleave(H // H_kv, dim=1)  # (B, H, N_max, D)
    scores = torch.einsum("bhid,bhnd->bhin", q.float(), kr) * D ** -0.5  # (B, H, N_q, N_max)
    n = torch.arange(N_max, device=q.device)
    for b, L in enumerate(lengths):
        for i in range(N_q):
            for s in range(S):
                keys = (n <= L - N_q + i) & ((n // block_n) % S == s)
                want = (torch.logsumexp(scores[b, :, i, keys], -1) if keys.any()
                        else torch.full((H,), -math.inf, device=q.device))
                torch.testing.assert_close(plan.lse_part[b, :, i, s], want, atol=1e-5,
                                           rtol=1e-5)


def test_the_two_merges_give_the_same_bits():
    """Both merges run the same code (_merge_row) with the same chunking: in the interpreter an
    eager step (fused) and a CUDA-graph step (the merge kernel) agree bit for bit (on a GPU the
    two compiled kernels may round the last bit differently: tests/test_ops.py)."""
    B, H, H_kv, N_q, N_max, D = 1, 8, 2, 1, 300, 32
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, [257], torch.float16)
    outs = []
    for merge in dec.MERGES:
        plan = dec.make_plan(B, H, H_kv, N_q, D, N_max, q.device, num_splits=7, merge=merge)
        out = torch.empty(B, H, N_q, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, H, N_q, device=q.device)
        dec.run_plan(plan, q, k, v, lens, None, D ** -0.5, out, lse)
        outs.append((out, lse))
    if course_lib.INTERPRET:
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(outs[0], outs[1], rtol=2 ** -10, atol=1e-6)


def test_unknown_merge_is_refused():
    with pytest.raises(ValueError, match="merge"):
        dec.make_plan(1, 2, 2, 1, 32, 16, "cpu", merge="atomic")


def test_paged_equals_flash_on_the_same_logical_data():
    q, k, v, lens = _inputs(3, 8, 2, 1, 90, 64, [90, 31, 64], torch.float16)
    gen = torch.Generator().manual_seed(3)
    k_pages, table = contiguous_to_pages(k, block_size=16, num_blocks=40, generator=gen)
    gen = torch.Generator().manual_seed(3)
    v_pages, _ = contiguous_to_pages(v, block_size=16, num_blocks=40, generator=gen)
    # Round trip of the layout helpers.
    assert torch.equal(pages_to_contiguous(k_pages, table, lens, n_max=90)[0], k[0])
    for splits in (1, 3):
        o_flash = flash_decode(q, k, v, lens, num_splits=splits)
        o_paged = paged_decode(q, k_pages, v_pages, table, lens, num_splits=splits)
        torch.testing.assert_close(o_paged, o_flash, atol=0, rtol=0)


def test_ignores_what_lies_past_each_length():
    q, k, v, lens = _inputs(2, 4, 2, 1, 64, 32, [20, 47], torch.float32)
    o1 = flash_decode(q, k, v, lens)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2[b, :, n:] = float("nan")
        v2[b, :, n:] = float("nan")
    o2 = flash_decode(q, k2, v2, lens)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("N_q", [1, 3])
@pytest.mark.parametrize("D", [40, 72, 80, 96, 112, 160, 192, 256])
def test_any_head_dim_multiple_of_8(D, N_q, monkeypatch):
    """Head dims that are multiples of 8 (most not powers of two), GQA, odd lengths."""
    _poison_kernel_outputs(monkeypatch)
    q, k, v, lens = _inputs(2, 4, 2, N_q, 45, D, [45, 19], DTYPES[0])
    o, lse = flash_decode(q, k, v, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, f"D={D}")


def test_gqa_equals_mha_with_repeated_kv():
    q, k, v, lens = _inputs(2, 8, 2, 1, 50, 32, [50, 9], torch.float32)
    o_gqa = flash_decode(q, k, v, lens)
    o_mha = flash_decode(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), lens)
    torch.testing.assert_close(o_gqa, o_mha, atol=1e-6, rtol=1e-6)


def test_strided_q_and_cache():
    # (B, N, H, D) storage seen as (B, H, N, D)
    B, N, H, D = 2, 33, 4, 32
    q = fresh_randn(B, 1, H, D).transpose(1, 2)
    k = fresh_randn(B, N, 2, D).transpose(1, 2)
    v = fresh_randn(B, N, 2, D).transpose(1, 2)
    lens = torch.tensor([33, 12], dtype=torch.int32, device=q.device)
    o, lse = flash_decode(q, k, v, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, "strided")


def test_extreme_logits_stay_finite():
    q, k, v, lens = _inputs(1, 2, 1, 2, 70, 32, [70], torch.float32)
    o, lse = flash_decode(q, k, v, lens, sm_scale=1e3, return_lse=True)
    ref_o, ref_lse = decode_reference(q, k, v, lens, sm_scale=1e3, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    # logits near 1e4 carry an fp32 rounding near 1e-3 (in the kernel and in the reference
    # alike); when two keys score within a few units of each other, their weights move by that
    torch.testing.assert_close(o, ref_o, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-5)


# ------------------------------------------------------------------------------- the variants
# (lesson 15): window, softcap, ALiBi, sinks, against reference.attention_variants per sequence

VARIANT_CASES = {  # name: the keywords (tensors made per test: their shapes need B and H)
    "window": dict(window_size=(13, -1)),  # right is 0: the decode is causal
    "window_causal": dict(window_size=(4, 0)),
    "window_self": dict(window_size=(0, 0)),  # each query sees its own key only
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi_slopes="H"),
    "alibi_per_sequence": dict(alibi_slopes="BH"),
    "sinks": dict(sinks="H"),
    "all": dict(window_size=(13, 0), softcap=2.5, alibi_slopes="BH", sinks="H"),
}


def _variant_kwargs(name, B, H, device):
    """VARIANT_CASES[name] with its tensors made: slopes of ALiBi's size (up to 0.5), sinks
    of a logit's size (so that they weigh as much as a key)."""
    gen = torch.Generator().manual_seed(11)
    made = {"H": lambda: torch.randn(H, generator=gen) * 2,
            "BH": lambda: torch.rand(B, H, generator=gen) * 0.5}
    kw = dict(VARIANT_CASES[name])
    for arg in ("alibi_slopes", "sinks"):
        if arg in kw:
            t = made[kw[arg]]()
            kw[arg] = (t.abs() * 0.25 if arg == "alibi_slopes" else t).to(device)
    return kw


def _variants_per_sequence(q, k, v, lens, same_precision=False, **kw):
    """(o, lse) of the variants' reference on each sequence's first L_b keys, causal and
    bottom-right aligned; in fp32, or in the inputs' dtype (the 2x rule's baseline)."""
    from course_lib.reference import attention_variants
    from course_lib.testing import variants_same_precision

    fn = variants_same_precision if same_precision else attention_variants
    n = [k.shape[2]] * q.shape[0] if lens is None else lens.tolist()
    outs, lses = [], []
    for b in range(q.shape[0]):
        kwb = dict(kw)
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.ndim == 2:
            kwb["alibi_slopes"] = slopes[b]
        o, lse = fn(q[b:b + 1], k[b:b + 1, :, :n[b]], v[b:b + 1, :, :n[b]], causal=True,
                    return_lse=True, **kwb)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check_variants(o, lse, q, k, v, lens, name, **kw):
    ref_o, ref_lse = _variants_per_sequence(q, k, v, lens, **kw)
    base_o, _ = _variants_per_sequence(q, k, v, lens, same_precision=True, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any(), f"{name}: an output element was never written (or is NaN)"
    assert not torch.isnan(lse).any(), f"{name}: an lse element was never written (or is NaN)"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{name}: rows that see no key"
    assert_close_2x(o, ref_o, base_o, name=f"{name} O")
    assert_close_2x(lse, ref_lse, ref_lse, name=f"{name} lse", atol=1e-4)


def _paged(k, v, block_size=8, seed=3):
    k_pages, table = contiguous_to_pages(k, block_size=block_size,
                                         generator=torch.Generator().manual_seed(seed))
    v_pages, _ = contiguous_to_pages(v, block_size=block_size,
                                     generator=torch.Generator().manual_seed(seed))
    return k_pages, v_pages, table


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("N_q", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_variants_match_the_reference(name, paged, N_q, num_splits, monkeypatch):
    """Each keyword alone and all together; GQA; 1 or 3 queries; ragged lengths, among them an
    empty sequence and one shorter than the window; one split, or three that are merged."""
    B, H, H_kv, N_max, D = 3, 4, 2, 70, 32
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, [70, 0, 9], DTYPES[-1])
    kw = _variant_kwargs(name, B, H, q.device)
    _poison_kernel_outputs(monkeypatch)
    if paged:
        k_pages, v_pages, table = _paged(k, v)
        o, lse = paged_decode(q, k_pages, v_pages, table, lens, num_splits=num_splits,
                              return_lse=True, **kw)
    else:
        o, lse = flash_decode(q, k, v, lens, num_splits=num_splits, return_lse=True, **kw)
    _check_variants(o, lse, q, k, v, lens, name, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("merge", dec.MERGES)
def test_planned_variants_with_either_merge(merge, dtype, monkeypatch):
    """plan_decode with every variant: the sinks join the splits in the fused merge and in
    the merge kernel, step after step; no lengths (every sequence uses all N_max keys)."""
    from course_lib.ops import plan_decode

    B, H, H_kv, N_q, N_max, D = 2, 8, 2, 3, 61, 32
    _, k, v, _ = _inputs(B, H, H_kv, N_q, N_max, D, None, dtype)
    kw = _variant_kwargs("all", B, H, k.device)
    _poison_kernel_outputs(monkeypatch)
    plan = plan_decode(fresh_randn(B, H, N_q, D, dtype=dtype), k, v, num_splits=3, merge=merge,
                       **kw)
    assert plan.plan.window == (13, 0) and plan._variant.softcap == 2.5
    for step in range(2):
        q = fresh_randn(B, H, N_q, D, dtype=dtype)
        o, lse = plan.run(q, k, v, return_lse=True)
        _check_variants(o, lse, q, k, v, None, f"merge={merge} step {step}", **kw)
    k_pages, v_pages, table = _paged(k, v)
    lens = torch.full((B,), N_max, dtype=torch.int32, device=k.device)
    paged = plan_decode(q, k_pages, v_pages, block_table=table, num_splits=3, merge=merge, **kw)
    o, lse = paged.run(q, k_pages, v_pages, lens, table, return_lse=True)
    _check_variants(o, lse, q, k, v, lens, f"paged merge={merge}", **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_a_window_reads_only_its_band(num_splits, paged):
    """Keys and values outside each sequence's band [L_b − N_q − left, L_b) hold NaN: one read
    would make the output NaN. The splits cut only the band, loaded under a mask from its first
    key, so the answer is finite and the reference's (computed on clean caches)."""
    B, H, H_kv, N_q, N_max, D, left = 3, 4, 2, 3, 150, 32, 21
    lengths = [150, 23, 97]
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, lengths, torch.float32)
    k_nan, v_nan = k.clone(), v.clone()
    n = torch.arange(N_max, device=q.device)
    for b, L in enumerate(lengths):
        outside = (n < L - N_q - left) | (n >= L)
        k_nan[b, :, outside] = float("nan")
        v_nan[b, :, outside] = float("nan")
    kw = dict(window_size=(left, 0), sinks=fresh_randn(H))
    if paged:
        k_pages, v_pages, table = _paged(k_nan, v_nan, block_size=16)
        o, lse = paged_decode(q, k_pages, v_pages, table, lens, num_splits=num_splits,
                              return_lse=True, **kw)
    else:
        o, lse = flash_decode(q, k_nan, v_nan, lens, num_splits=num_splits, return_lse=True,
                              **kw)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), "a key outside the band read"
    _check_variants(o, lse, q, k, v, lens, f"{num_splits} splits", **kw)


def test_the_splits_share_only_the_band(monkeypatch):
    """Split s of a window decode holds the lse of its run of the band's tiles: the runs start
    at the band's first tile, not at key 0 (two causal queries, three splits, merge kernel)."""
    B, H, H_kv, N_q, N_max, D, left, S = 1, 2, 1, 2, 150, 32, 40, 3
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, [137], torch.float32)
    plan = dec.make_plan(B, H, H_kv, N_q, D, N_max, q.device, num_splits=S, merge="kernel",
                         window=(left, 0))
    out, lse = torch.empty_like(q), torch.empty(B, H, N_q, device=q.device)
    dec.run_plan(plan, q, k, v, lens, None, D ** -0.5, out, lse)
    bn, L = plan.config["BLOCK_N"], 137
    first = (L - N_q - left) // bn * bn  # the first tile any row sees
    per_split = -(-(-(-(L - first) // bn)) // S)  # tiles per split, of the band's
    scores = torch.einsum("hid,hnd->hin", q[0], k[0].expand(H, -1, -1)) * D ** -0.5
    n = torch.arange(N_max, device=q.device)
    for i in range(N_q):
        p = L - N_q + i
        for s in range(S):
            lo = first + s * per_split * bn
            keys = (n >= max(lo, p - left)) & (n < min(lo + per_split * bn, p + 1))
            want = (torch.logsumexp(scores[:, i, keys], -1) if keys.any()
                    else torch.full((H,), -math.inf, device=q.device))
            torch.testing.assert_close(plan.lse_part[0, :, i, s], want, atol=1e-5, rtol=1e-5)
    _check_variants(out, lse, q, k, v, lens, "merged", window_size=(left, 0))


def test_a_window_bounds_the_work_the_splits_are_chosen_for():
    """The split count and tile order follow the keys a sequence reads: left + N_q with a
    window, not the cache's length (on the GPU's rule; the interpreter caps the count)."""
    full = dec.make_plan(1, 32, 8, 1, 128, 4096, "cpu", sm_count=132)
    window = dec.make_plan(1, 32, 8, 1, 128, 4096, "cpu", sm_count=132, window=(16, 0))
    assert full.num_splits > 1 and window.num_splits == 1
    wide = dec.make_plan(1, 32, 8, 1, 128, 4096, "cpu", sm_count=132, window=(8192, 0))
    assert wide.num_splits == full.num_splits  # a window wider than the cache bounds nothing


def test_default_keywords_are_plain_attention():
    """Explicit defaults, a window (-1, right) (the decode is causal: right is 0) and a zero
    cap give plain decode, bit for bit."""
    q, k, v, lens = _inputs(2, 4, 2, 3, 40, 32, [40, 11], torch.float32)
    want = flash_decode(q, k, v, lens, num_splits=2)
    for kw in (dict(window_size=(-1, -1)), dict(window_size=[-1, 5]), dict(softcap=0),
               dict(window_size=(100, 0))):
        assert torch.equal(flash_decode(q, k, v, lens, num_splits=2, **kw), want), kw


def test_variant_operators_opcheck_and_compile():
    """The operators carry the variants (schema with defaults, fake implementations):
    opcheck, and torch.compile(fullgraph=True) gives the eager answer."""
    B, H, H_kv, N_q, N_max, D = 2, 4, 2, 3, 40, 16
    q, k, v, lens = _inputs(B, H, H_kv, N_q, N_max, D, [40, 13], torch.float32)
    kw = _variant_kwargs("all", B, H, q.device)
    variants = (13, kw["softcap"], kw["alibi_slopes"], kw["sinks"])
    torch.library.opcheck(torch.ops.course.flash_decode.default,
                          (q, k, v, lens, 0, 0.25, *variants))
    torch.library.opcheck(torch.ops.course.flash_decode.default, (q, k, v, lens, 2, 0.25))
    k_pages, v_pages, table = _paged(k, v)
    torch.library.opcheck(torch.ops.course.paged_decode.default,
                          (q, k_pages, v_pages, table, lens, 3, 0.25, *variants))
    torch._dynamo.reset()

    def step(q, k, v, lens, k_pages, v_pages, table):
        return (flash_decode(q, k, v, lens, **kw),
                paged_decode(q, k_pages, v_pages, table, lens, num_splits=2, **kw))

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, lens, k_pages,
                                                                    v_pages, table)
    for g, w in zip(got, step(q, k, v, lens, k_pages, v_pages, table)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_variants_read_nothing_back_from_the_device(monkeypatch):
    """On a GPU (``_FREE_READS`` False) the default calls with the variants read no value."""
    from course_lib.ops import plan_decode

    monkeypatch.setattr(opd, "_FREE_READS", False)
    q, k, v, lens = _inputs(2, 4, 2, 1, 40, 16, [40, 13], torch.float32)
    kw = _variant_kwargs("all", 2, 4, q.device)
    k_pages, v_pages, table = _paged(k, v)

    def calls():
        flash_decode(q, k, v, lens, num_splits=2, **kw)
        paged_decode(q, k_pages, v_pages, table, lens, **kw)
        plan_decode(q, k, v, **kw).run(q, k, v, lens)

    assert reads_back(calls) == 0


def test_variant_calls_repeat_their_plans_bound_launch(monkeypatch, request):
    """flash_decode with the variants (a stand-in for the bound split kernel records the
    launches): the variants (``VARIANT``, the sinks as their address) are a free argument after
    the cache's geometry, so a layer with sinks of its own reuses the plan's bound launch
    instead of binding anew; another window is another plan."""
    from course_lib.kernels import decode as kd

    launched, bound = [], []
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: bound.append(kw) or [
        lambda *p: launched.append(p)])
    opd.forget_plans()
    request.addfinalizer(opd.forget_plans)  # the stand-in's launches must not outlive the test
    B, H, H_kv, D, N = 1, 4, 2, 16, 40
    q, k, v = fresh_randn(B, H, 1, D), fresh_randn(B, H_kv, N, D), fresh_randn(B, H_kv, N, D)
    sinks = [fresh_randn(H), fresh_randn(H)]  # two layers
    for layer in (0, 1):
        flash_decode(q, k, v, window_size=(8, 0), sinks=sinks[layer])
    assert len(bound) == 1 and bound[0]["variant"].sinks is sinks[0], "the second layer bound anew"
    assert launched[-1][-1] == (8, 0, None, None, None, sinks[1].data_ptr())
    flash_decode(q, k, v, window_size=(8, 0), sinks=sinks[0])
    assert len(bound) == 1 and launched[-1][-1][-1] == sinks[0].data_ptr()
    flash_decode(q, k, v, window_size=(9, 0), sinks=sinks[0])  # another window: another plan
    assert len(bound) == 2
    with pytest.raises(TypeError, match="window_size"):
        flash_decode(q, k, v, window_size=(8.0, 0), sinks=sinks[0])  # 8.0 == 8: still checked


def _bad_variants():
    """(keywords, error, message): every bad variant argument, named."""
    B, H = 2, 4
    return [
        (dict(window_size=(-2, 0)), ValueError, "window_size must be >= -1"),
        (dict(window_size=8), TypeError, "window_size must be a pair"),
        (dict(window_size=(8, True)), TypeError, "window_size must be a pair"),
        (dict(softcap=-1.0), ValueError, "softcap must be > 0"),
        (dict(softcap=True), TypeError, "softcap must be a number"),
        (dict(alibi_slopes=torch.ones(H + 1)), ValueError, r"alibi_slopes must have shape"),
        (dict(alibi_slopes=torch.ones(B, H, dtype=torch.float16)), TypeError,
         "alibi_slopes must be float32"),
        (dict(alibi_slopes=[0.5] * H), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(sinks=torch.ones(B, H)), ValueError, r"sinks must have shape \(4\)"),
        (dict(sinks=torch.ones(H, dtype=torch.float64)), TypeError, "sinks must be float32"),
    ]


@pytest.mark.parametrize("kw, error, message", _bad_variants(),
                         ids=[f"{next(iter(c[0]))}-{i}" for i, c in enumerate(_bad_variants())])
def test_bad_variants_name_the_argument(kw, error, message):
    from course_lib.ops import plan_decode

    q, k, v, lens = _small()
    kw = {n: t.to(q.device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    k_pages, table = contiguous_to_pages(k, block_size=16, num_blocks=6)
    v_pages, _ = contiguous_to_pages(v, block_size=16, num_blocks=6)
    for call in (lambda: flash_decode(q, k, v, lens, **kw),
                 lambda: flash_decode(q, k, v, lens, **kw),  # a repeat checks it too
                 lambda: paged_decode(q, k_pages, v_pages, table, lens, **kw),
                 lambda: plan_decode(q, k, v, **kw)):
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("sink", [None, 1.5, 30.0])
def test_the_merge_adds_the_sink(sink):
    """The merge kernel with HAS_SINK: the sink is one more term of the denominator with no
    value; a row no split saw (all lse_s = -inf) gets o = 0 and lse = the sink."""
    import triton

    gen = torch.Generator().manual_seed(1)
    S, D = 5, 16
    s = torch.randn(2, 40, generator=gen) * 3  # two rows' scores
    vals = torch.randn(40, D, generator=gen)
    bounds = [0, 3, 3, 20, 33, 40]
    o_part = torch.full((2, S, D), float("nan"))
    lse_part = torch.full((2, S), float("-inf"))
    for i in range(S):
        lo, hi = bounds[i], bounds[i + 1]
        if lo < hi:
            lse_part[0, i] = torch.logsumexp(s[0, lo:hi], -1)
            o_part[0, i] = torch.softmax(s[0, lo:hi], -1) @ vals[lo:hi]
    logits = s[0] if sink is None else torch.cat([s[0], torch.tensor([sink])])
    want_lse = [torch.logsumexp(logits, -1), -math.inf if sink is None else sink]
    want_o = [torch.softmax(logits, -1)[:40] @ vals, torch.zeros(D)]  # row 1: no key
    dev = course_lib.DEVICE
    sinks = torch.full((1,), 0.0 if sink is None else sink, device=dev)
    out = poison_(torch.empty(2, 1, 1, D, device=dev))  # (B, H, N_q, D): rows are sequences
    lse = poison_(torch.empty(2, 1, 1, device=dev))
    dec._decode_merge_kernel[(1,)](o_part.to(dev), lse_part.to(dev), out, lse, sinks, 1, 2, D, D,
                                   D, N_Q=1, NUM_SPLITS=S, BLOCK_S=triton.next_power_of_2(S),
                                   HEAD_DIM=D, CHUNK=4, ROWS=4, HAS_SINK=sink is not None)
    for r in range(2):
        torch.testing.assert_close(out[r].reshape(D).cpu(), want_o[r], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[r].reshape(()).cpu(),
                                   torch.as_tensor(float(want_lse[r])), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- the LSE merge

def test_lse_merge_kernel_on_its_own():
    """Hand the merge kernel partial results computed in torch and compare with full softmax."""
    import triton

    gen = torch.Generator().manual_seed(0)
    B, H, N_q, S, D, N = 1, 2, 1, 5, 16, 40
    s = torch.randn(B, H, N_q, N, generator=gen) * 3  # scores
    vals = torch.randn(N, D, generator=gen)
    bounds = [0, 3, 3, 20, 33, 40]  # split 1 is empty
    o_part = torch.empty(B, H, N_q, S, D)
    lse_part = torch.empty(B, H, N_q, S)
    for i in range(S):
        lo, hi = bounds[i], bounds[i + 1]
        if lo == hi:
            lse_part[..., i] = float("-inf")
            o_part[..., i, :] = float("nan")  # never read: an empty split weighs nothing
            continue
        lse_part[..., i] = torch.logsumexp(s[..., lo:hi], -1)
        o_part[..., i, :] = torch.softmax(s[..., lo:hi], -1) @ vals[lo:hi]
    want_lse = torch.logsumexp(s, -1)
    want_o = torch.softmax(s, -1) @ vals
    dev = course_lib.DEVICE
    o_part, lse_part = o_part.to(dev), lse_part.to(dev)
    out = poison_(torch.empty(B, H, N_q, D, device=dev))
    lse = poison_(torch.empty(B, H, N_q, device=dev))
    dec._decode_merge_kernel[(B * H * N_q,)](
        o_part, lse_part, out, lse, lse, H, B * H * N_q, out.stride(0), out.stride(1),
        out.stride(2),
        N_Q=N_q, NUM_SPLITS=S, BLOCK_S=triton.next_power_of_2(S), HEAD_DIM=D)
    torch.testing.assert_close(out.cpu(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)


def test_num_splits_heuristic():
    s1 = dec.choose_num_splits(1, 8, 131072, 64, sm_count=132)
    assert s1 * 8 <= 132 < 2 * s1 * 8  # one wave: at most 1 program per SM, at least half full
    assert s1 & (s1 - 1) == 0  # a power of two
    assert dec.choose_num_splits(8, 8, 131072, 64, sm_count=132) == 2
    assert dec.choose_num_splits(64, 8, 131072, 64, sm_count=132) == 1
    assert dec.choose_num_splits(1, 8, 64, 64, sm_count=132) == 1
    for batch in (1, 2, 8, 64):
        for n in (1, 100, 4096, 131072):
            s = dec.choose_num_splits(batch, 8, n, 64, sm_count=132)
            assert 1 <= s <= dec.MAX_SPLITS
            assert s == 1 or math.ceil(n / s) >= 64  # never less than a tile a split


def test_tiles_follow_the_gpus_bandwidth(monkeypatch):
    """Little's law picks the tile: 64-key tiles where they keep enough bytes in flight for the
    GPU's bandwidth per SM (an H100's), 128-key tiles where they do not (an H200's) and the
    splits are long; short splits and many unsplit programs keep their own choice."""
    from types import SimpleNamespace

    from course_lib.hardware import dram_bandwidth
    from course_lib.kernels import decode_plan

    h100 = SimpleNamespace(memory_clock_rate=2619000, memory_bus_width=5120)
    h200 = SimpleNamespace(memory_clock_rate=3201000, memory_bus_width=6016)
    assert round(dram_bandwidth(h100) / 1e12, 2) == 3.35
    assert round(dram_bandwidth(h200) / 1e12, 2) == 4.81
    assert dram_bandwidth(SimpleNamespace()) is None
    monkeypatch.setattr(decode_plan, "INTERPRET", False)  # the GPU's rule, on any machine
    for (B, N), want in {(1, 131072): (64, 128), (8, 131072): (64, 128), (8, 4096): (64, 128),
                         (1, 4096): (64, 64), (64, 2048): (64, 64)}.items():
        got = tuple(dec.pick_config(128, B, 8, N, sm_count=132,
                                    bandwidth_per_sm_=dram_bandwidth(gpu) / 132)["BLOCK_N"]
                    for gpu in (h100, h200))
        assert got == want, f"B {B} N {N}: {got}"
    assert dec.pick_config(128, 64, 8, 2048, sm_count=132)["num_stages"] == 2


# ------------------------------------------------------------------------------- bad input

def _small():
    return _inputs(2, 4, 2, 1, 32, 32, [32, 10], torch.float16)


def test_flash_decode_bad_input_names_the_argument():
    q, k, v, lens = _small()
    # validate=True reads the lengths' values on every device (on a GPU, a synchronisation)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        flash_decode(q, k, v, lens + 30, validate=True)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        flash_decode(q, k, v, lens - 11, validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(2,\)"):
        flash_decode(q, k, v, lens[:1])
    with pytest.raises(TypeError, match="cache_seqlens must hold integers"):
        flash_decode(q, k, v, lens.float())
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.Tensor"):
        flash_decode(q, k, v, [32, 10])
    with pytest.raises(ValueError, match="num_splits must be in"):
        flash_decode(q, k, v, lens, num_splits=0)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_decode(q, k, v, lens, num_splits=2.0)
    with pytest.raises(ValueError, match="multiple of"):
        flash_decode(fresh_randn(2, 3, 1, 32, dtype=torch.float16), k, v, lens)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_decode(q[0], k, v, lens)


def test_paged_decode_bad_input_names_the_argument():
    q, k, v, lens = _small()
    k_pages, table = contiguous_to_pages(k, block_size=16, num_blocks=6)
    v_pages, _ = contiguous_to_pages(v, block_size=16, num_blocks=6)
    bad = table.clone()
    bad[1, 0] = 6  # sequence 1 (10 keys) uses its block 0: out of range
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 6"):
        paged_decode(q, k_pages, v_pages, bad, lens, validate=True)
    bad = table.clone()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="block_table"):
        paged_decode(q, k_pages, v_pages, bad, lens, validate=True)
    unused = table.clone()
    unused[1, 1] = 99  # sequence 1 never reaches its block 1: ignored
    paged_decode(q, k_pages, v_pages, unused, lens, validate=True)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        paged_decode(q, k_pages, v_pages, table, lens + 1, validate=True)  # 33 > 2 blocks × 16
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        paged_decode(q, k_pages, v_pages, table, None)
    with pytest.raises(TypeError, match="block_table must hold integers"):
        paged_decode(q, k_pages, v_pages, table.float(), lens)
    with pytest.raises(ValueError, match="block_table must have shape"):
        paged_decode(q, k_pages, v_pages, table[:1], lens)
    with pytest.raises(ValueError, match="k_pages and v_pages must have one shape"):
        paged_decode(q, k_pages, v_pages[:5], table, lens)
    with pytest.raises(ValueError, match="k_pages must have 4 dimensions"):
        paged_decode(q, k_pages[0], v_pages, table, lens)


cpu_only = pytest.mark.skipif(course_lib.DEVICE != "cpu",
                              reason="the default checks values only where reading is free")


@cpu_only
@pytest.mark.parametrize("bad_len", [33, -1])
def test_flash_decode_default_refuses_a_length_outside_the_cache_on_the_cpu(bad_len):
    """With default arguments, a length outside [0, N_max] is an error on the CPU."""
    q, k, v, lens = _small()  # N_max 32
    bad = lens.clone()
    bad[1] = bad_len
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 32\]"):
        flash_decode(q, k, v, bad)
    o = flash_decode(q, k, v, bad, validate=False)  # unchecked: the kernel clamps, no error
    assert torch.isfinite(o).all()


@cpu_only
def test_a_repeated_call_still_checks_the_lengths_on_the_cpu(monkeypatch, request):
    """A call shaped like an earlier one repeats its plan's bound launch (a stand-in for the
    bound split kernel records the launches, as the interpreter binds none): on the CPU the
    lengths' values are checked first, unless validate=False."""
    from course_lib.kernels import decode as kd

    launched, bound = [], []
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: bound.append(kw) or [
        lambda *p: launched.append(p)])
    opd.forget_plans()
    request.addfinalizer(opd.forget_plans)  # the stand-in's launches must not outlive the test
    q, k, v, lens = _small()
    flash_decode(q, k, v, lens)
    flash_decode(q, k, v, lens.clone())
    assert len(bound) == 1 and len(launched) == 1, "the plan's bound launch was not repeated"
    bad = lens.clone()
    bad[0] = 33
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 32\]"):
        flash_decode(q, k, v, bad)
    assert len(launched) == 1
    flash_decode(q, k, v, bad, validate=False)  # repeated, unchecked
    assert len(bound) == 1 and len(launched) == 2


@cpu_only
def test_paged_decode_default_refuses_a_block_id_outside_the_pool_on_the_cpu():
    q, k, v, lens = _small()  # lengths 32 and 10: two blocks of 16 and one
    k_pages, table = contiguous_to_pages(k, block_size=16, num_blocks=6,
                                         generator=torch.Generator().manual_seed(0))
    v_pages, _ = contiguous_to_pages(v, block_size=16, num_blocks=6,
                                     generator=torch.Generator().manual_seed(0))
    for b, j, block in ((1, 0, 6), (0, 1, -1)):
        bad = table.clone()
        bad[b, j] = block
        with pytest.raises(ValueError, match=rf"block_table\[{b}, {j}\] = {block} "):
            paged_decode(q, k_pages, v_pages, bad, lens)
        o = paged_decode(q, k_pages, v_pages, bad, lens, validate=False)  # clamped: no error
        assert torch.isfinite(o).all()
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 32\]"):
        paged_decode(q, k_pages, v_pages, table, lens + 1)
    unused = table.clone()
    unused[1, 1] = 99  # sequence 1 never reaches its block 1: not an error
    torch.testing.assert_close(paged_decode(q, k_pages, v_pages, unused, lens),
                               paged_decode(q, k_pages, v_pages, table, lens), rtol=0, atol=0)


@cpu_only
def test_plan_run_checks_the_values_at_every_step_on_the_cpu():
    from course_lib.ops import plan_decode

    q, k, v, lens = _small()
    plan = plan_decode(q, k, v)
    want = plan.run(q, k, v, lens).clone()
    for bad_len in (33, -1):  # the same tensor, changed in place: the bound launch's step
        bad = lens.clone()
        plan.run(q, k, v, bad)
        bad[0] = bad_len
        with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 32\]"):
            plan.run(q, k, v, bad)
        plan.run(q, k, v, bad, validate=False)  # clamped: no error
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        plan.run(q, k, v, lens.long())  # a run launches with what it is given: int32 only
    torch.testing.assert_close(plan.run(q, k, v, lens), want, rtol=0, atol=0)

    k_pages, table = contiguous_to_pages(k, block_size=16, num_blocks=6,
                                         generator=torch.Generator().manual_seed(0))
    v_pages, _ = contiguous_to_pages(v, block_size=16, num_blocks=6,
                                     generator=torch.Generator().manual_seed(0))
    paged = plan_decode(q, k_pages, v_pages, block_table=table)
    torch.testing.assert_close(paged.run(q, k_pages, v_pages, lens, table), want, rtol=0,
                               atol=0)
    bad = table.clone()
    bad[1, 0] = 6
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 6 "):
        paged.run(q, k_pages, v_pages, lens, bad)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 32\]"):
        paged.run(q, k_pages, v_pages, lens + 1, table)
    with pytest.raises(ValueError, match="this plan's block_table is"):
        paged.run(q, k_pages, v_pages, lens, table[:, :1].contiguous())
    paged.run(q, k_pages, v_pages, lens, bad, validate=False)  # clamped: no error


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    q, k, v, lens = _inputs(1, 2, 2, 1, 16, 32, None, torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        flash_decode(q, k, v)
    k_pages, table = contiguous_to_pages(k)
    with pytest.raises(TypeError, match="bfloat16"):
        paged_decode(q, k_pages, k_pages, table, torch.tensor([16], dtype=torch.int32))


# ------------------------------------------------------------------------------- GPU sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N_q", [1, 4])
def test_gpu_long_ragged_batch(N_q, dtype):
    lengths = [32768, 4097, 1, 20000]
    q, k, v, lens = _inputs(4, 32, 8, N_q, 32768, 128, lengths, dtype)
    o, lse = flash_decode(q, k, v, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, "flash_decode GPU")
    gen = torch.Generator().manual_seed(11)
    k_pages, table = contiguous_to_pages(k, generator=gen)
    gen = torch.Generator().manual_seed(11)
    v_pages, _ = contiguous_to_pages(v, generator=gen)
    o_p, lse_p = paged_decode(q, k_pages, v_pages, table, lens, return_lse=True)
    _check(o_p, lse_p, q, k, v, lens, "paged_decode GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_long_context_deals_the_tiles(paged):
    """At batch 1 and 64k keys the plan deals the tiles round-robin (16 splits of 64 tiles);
    a length that ends inside a tile, contiguous and paged: the reference's answer."""
    q, k, v, lens = _inputs(1, 32, 8, 1, 65536, 128, [40001], torch.float16)
    assert dec.make_plan(1, 32, 8, 1, 128, 65536, q.device).interleaved
    if paged:
        k_pages, table = contiguous_to_pages(k, generator=torch.Generator().manual_seed(5))
        v_pages, _ = contiguous_to_pages(v, generator=torch.Generator().manual_seed(5))
        o, lse = paged_decode(q, k_pages, v_pages, table, lens, return_lse=True)
    else:
        o, lse = flash_decode(q, k, v, lens, return_lse=True)
    _check(o, lse, q, k, v, lens, "tiles dealt round-robin")


@pytest.mark.gpu
@pytest.mark.parametrize("config", TUNE_CONFIGS, ids=lambda c: "n{BLOCK_N}w{num_warps}"
                         "s{num_stages}".format(**c))
def test_gpu_every_tuning_config_is_correct(config):
    q, k, v, lens = _inputs(2, 32, 8, 1, 5000, 128, [5000, 777], torch.float16)
    plan = dec.make_plan(2, 32, 8, 1, 128, 5000, q.device, config=config)
    o, lse = torch.empty_like(q), torch.empty(2, 32, 1, device=q.device)
    dec.run_plan(plan, q, k, v, lens, None, 128 ** -0.5, o, lse)
    _check(o, lse, q, k, v, lens, str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("N_q", [1, 4])
@pytest.mark.parametrize("name", ["window_causal", "all"])
def test_gpu_variants_on_a_long_ragged_batch(name, N_q, paged, dtype):
    """A sliding window of 1024 over caches up to 32k (the split count chosen for the band),
    alone and with softcap, ALiBi and sinks; the variants' keys NaN outside each band."""
    lengths = [32768, 4097, 1, 20000]
    q, k, v, lens = _inputs(4, 32, 8, N_q, 32768, 128, lengths, dtype)
    kw = _variant_kwargs(name, 4, 32, q.device)
    kw["window_size"] = (1024, 0)
    k_nan, v_nan = k.clone(), v.clone()
    n = torch.arange(k.shape[2], device=q.device)
    for b, L in enumerate(lengths):
        outside = (n < L - N_q - 1024) | (n >= L)
        k_nan[b, :, outside] = float("nan")
        v_nan[b, :, outside] = float("nan")
    if paged:
        k_pages, v_pages, table = _paged(k_nan, v_nan, block_size=16)
        o, lse = paged_decode(q, k_pages, v_pages, table, lens, return_lse=True, **kw)
    else:
        o, lse = flash_decode(q, k_nan, v_nan, lens, return_lse=True, **kw)
    _check_variants(o, lse, q, k, v, lens, f"{name} GPU", **kw)


@pytest.mark.gpu
def test_gpu_variant_layers_repeat_and_replay_in_a_cuda_graph():
    """Eagerly, layers with sinks of their own repeat one bound launch with each layer's sinks
    (right for every layer, step after step); a planned step with every variant replays in a
    CUDA graph (the merge kernel adds the sinks there)."""
    from course_lib.ops import plan_decode

    B, H, H_kv, N_q, N, D = 2, 32, 8, 1, 4096, 128
    _, k, v, lens = _inputs(B, H, H_kv, N_q, N, D, [4096, 1500], torch.float16)
    layers = [_variant_kwargs("all", B, H, k.device) for _ in range(3)]
    for i, kw in enumerate(layers):
        kw["sinks"], kw["window_size"] = fresh_randn(H, seed=i, scale=2.0), (1000, 0)
    for step in range(2):
        q = fresh_randn(B, H, N_q, D, dtype=torch.float16)
        for i, kw in enumerate(layers):
            o, lse = flash_decode(q, k, v, lens, return_lse=True, **kw)
            _check_variants(o, lse, q, k, v, lens, f"step {step} layer {i}", **kw)
            o = flash_decode(q, k, v, lens, **kw)  # the repeat path (no lse returned)
            _check_variants(o, lse, q, k, v, lens, f"repeat {step} layer {i}", **kw)
    kw = layers[0]
    q = fresh_randn(B, H, N_q, D, dtype=torch.float16)
    plan = plan_decode(q, k, v, num_splits=8, **kw)
    plan.run(q, k, v, lens)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, k, v, lens, return_lse=True)
    for step in range(2):
        q.copy_(fresh_randn(*q.shape, dtype=q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check_variants(out, lse, q, k, v, lens, f"graph replay {step}", **kw)


# ------------------------------------------------------------------------------- the lesson's
# other pieces: split partition, widget, IO model, benchmark bookkeeping

def test_split_bounds_is_the_kernels_partition(monkeypatch):
    """Each split's lse from the kernel equals the lse of the keys split_bounds gives it."""
    from course_lib.kernels.decode import split_bounds

    q, k, v, lens = _inputs(1, 2, 2, 1, 100, 32, [100], torch.float32)
    block_n = dec.pick_config(32)["BLOCK_N"]
    lse_parts = {}

    seen = []
    _poison_kernel_outputs(monkeypatch, seen)  # (and a new plan: its buffers are seen)
    flash_decode(q, k, v, lens, num_splits=3)
    lse_parts["t"], = [t for t in seen if t.ndim == 4 and t.dtype == torch.float32
                       and t.shape[-1] == 3]  # the splits' lse_part
    got = lse_parts["t"][0, :, 0].cpu()  # (H, splits)
    s = torch.einsum("hd,hnd->hn", q[0, :, 0].float(), k[0].float()) * 32 ** -0.5  # (H, N)
    for i, (lo, hi) in enumerate(split_bounds(100, 3, block_n)):
        want = torch.logsumexp(s[:, lo:hi], -1) if lo < hi else torch.full((2,), -math.inf)
        torch.testing.assert_close(got[:, i], want.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L, splits, block_n", [(100, 4, 16), (20, 4, 16), (1, 3, 8),
                                                 (256, 10, 64)])
def test_split_kv_widget_merge_equals_one_pass(L, splits, block_n):
    from course_lib.widgets.split_kv import draw_split_kv, split_kv

    r = split_kv(L, splits, block_n)
    np = pytest.importorskip("numpy")
    np.testing.assert_allclose(r.merged, r.reference, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r.merged_lse, r.reference_lse, rtol=1e-12)
    assert abs(r.weights.sum() - 1) < 1e-12
    fig = draw_split_kv(L, splits, block_n)
    assert len(fig.axes) >= 3


def test_merge_exercise_solution_equals_the_merge_kernel():
    """The numpy merge of the exercise and the Triton merge kernel agree."""
    import numpy as np
    import triton

    from course_lib.exercises.decode import merge_partials_solution

    rng = np.random.default_rng(5)
    S, D = 6, 16
    o_parts = rng.standard_normal((S, D))
    lse_parts = rng.standard_normal(S) * 4
    lse_parts[2] = -np.inf
    dev = course_lib.DEVICE
    o_t = torch.tensor(o_parts, dtype=torch.float32, device=dev).view(1, 1, 1, S, D)
    lse_t = torch.tensor(lse_parts, dtype=torch.float32, device=dev).view(1, 1, 1, S)
    out = poison_(torch.empty(1, 1, 1, D, device=dev))
    lse = poison_(torch.empty(1, 1, 1, device=dev))
    dec._decode_merge_kernel[(1,)](o_t, lse_t, out, lse, lse, 1, 1, D, D, D, N_Q=1, NUM_SPLITS=S,
                                   BLOCK_S=triton.next_power_of_2(S), HEAD_DIM=D, CHUNK=4)
    want_o, want_lse = merge_partials_solution(o_parts, lse_parts)
    np.testing.assert_allclose(out.cpu().numpy().ravel(), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.item(), want_lse, rtol=1e-6)


def test_iomodel_decode_numbers():
    from course_lib.iomodel import decode as io

    thirteen = io.MODELS["Llama-2-13B"]
    per_token_mb = io.kv_bytes_per_token(thirteen) / 1e6
    assert 0.7 <= per_token_mb <= 1.0  # vLLM (Kwon et al. 2023) counts 0.8 MB for OPT-13B
    # GQA: Llama-2-70B's 8 K/V heads instead of 64 divide the cache by 8
    seventy = io.MODELS["Llama-2-70B"]
    assert io.kv_bytes_per_token(seventy, n_kv_heads=64) == 8 * io.kv_bytes_per_token(seventy)
    # decode intensity = group size (fp16, N_q = 1), far under any GPU's ridge point
    for h_kv, want in ((32, 1.0), (8, 4.0), (1, 32.0)):
        got = io.decode_attention_io(1, 32, h_kv, 1, 131072, 128)["intensity"]
        assert abs(got - want) / want < 0.01
    assert io.fa_forward_programs(1, 32, 1) == 32 and io.sm_fraction(32, 132) == 32 / 132
    assert io.split_kv_programs(1, 8, 66) == 528
    assert io.max_cached_tokens(thirteen, 80) > 0 and io.max_cached_tokens(seventy, 80) == 0


def test_figures_draw():
    from matplotlib.figure import Figure

    from course_lib.bench import decode as bench
    from course_lib.iomodel import decode as io
    from course_lib.widgets import split_kv

    for mod, prefix in ((io, "11_"), (split_kv, "12_")):
        for name, make in mod.FIGURES.items():
            assert name.startswith(prefix) and isinstance(make(), Figure)
    assert set(bench.FIGURES) == {"12_decode_bandwidth"}


def _fake_result():
    from course_lib.bench import decode as bench

    def measure(name, shape):
        if name == "sdpa-MATH" and shape["N"] > 4096:
            raise RuntimeError("refused\nsecond line")
        base = bench.kv_bytes(shape) / 3.0e12 * 1e3  # ms at 3 TB/s
        return {"ms": base * {"flash_decode": 1.0, "paged_decode": 1.05}.get(name, 1.2)}

    rows = bench.run_sweep(bench.shapes(), list(bench.PROVIDERS), measure, copy_gbs=3300.0,
                           progress=False)
    return {"providers": list(bench.PROVIDERS), "copy_gbs": 3300.0, "rows": rows,
            "environment": {"gpu": "fake"}}


def test_bench_bookkeeping_with_a_fake_timer():
    from course_lib.bench import decode as bench

    result = _fake_result()
    rec = bench._rec(result, 1, 131072, "flash_decode")
    assert abs(rec["tbs"] - 3.0) < 1e-9 and abs(rec["copy_fraction"] - 3000 / 3300) < 1e-9
    assert bench._rec(result, 8, 131072, "sdpa-MATH")["error"] == "RuntimeError: refused"
    met = {t["target"]: t["met"] for t in bench.targets(result)}
    assert met["B=1 N=128k flash_decode KV bw / copy bw"] is True
    assert met["B=1 N=4k flash_decode latency / CUDNN_ATTENTION"] is True
    assert all(v for k, v in met.items() if "paged" in k)
    text = bench.report(result)
    assert "targets" in text and "flash %copy" in text and "not timed" in text
    assert bench.plot_decode(result) is not None


def test_bench_needs_a_gpu():
    from course_lib.bench import decode as bench

    if course_lib.DEVICE == "cuda":
        pytest.skip("checks the CPU path")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick"])


def test_overhead_model_of_the_lesson():
    """Lesson 12 §8's host/GPU lanes: max(t_h, t_g) per call, t_h + t_g with a read-back."""
    from course_lib.diagrams import overhead

    for t_h, t_g in ((10.0, 20.0), (40.0, 20.0)):
        host, gpu = overhead.schedule(t_h, t_g, 50)
        assert gpu[-1][1] == pytest.approx(min(t_h, t_g) + 50 * max(t_h, t_g))
        assert all(g0 >= h1 for (_, h1), (g0, _) in zip(host, gpu))  # launched, then run
    _, gpu = overhead.schedule(40.0, 20.0, 50, sync_every=1)
    assert gpu[-1][1] == pytest.approx(50 * 60.0)
    assert len(overhead.draw_lanes().axes) == 3
