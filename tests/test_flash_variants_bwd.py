"""The variants' backward (kernels.flash_variants_bwd) and their public operators
(ops.flash_attn_v2's keywords, ops.flash_attn_varlen): every gradient, the sinks' included,
under the 2x rule against fp64 autograd of reference.attention_variants; packed sequences;
the dK/dV program's row ranges against masks.block_row_range; packed sequences read and written
in place; errors that name the argument; the torch.library operators (opcheck, torch.compile)."""
import itertools

import pytest
import torch
import triton
import triton.language as tl

from course_lib import masks
from course_lib.kernels import flash_bwd, flash_variants_bwd
from course_lib.kernels.band import _band_rows, variant_args
from course_lib.kernels.flash_variants import forward_variants_varlen
from course_lib.kernels.flash_variants_bwd import backward_variants_varlen
from course_lib.masks import Variant
from course_lib.ops import flash_attn_v2, flash_attn_varlen
from course_lib.reference import attention_variants, attention_varlen
from course_lib.testing import KERNEL_DTYPES, assert_close_2x, fresh_randn

SHAPES = [  # B, H, H_kv, N_q, N_k, D
    (1, 4, 2, 37, 37, 64),
    (2, 2, 1, 17, 70, 32),   # a chunk of new queries against a longer cache
    (1, 2, 1, 70, 23, 40),   # N_q > N_k (rows that see no key), a padded head dim
]
VARIANTS = {  # name: (causal, window_size, softcap, alibi, sinks)
    "window": (False, (8, 3), 0.0, False, False),
    "window causal": (True, (12, -1), 0.0, False, False),
    "softcap": (False, (-1, -1), 3.0, False, False),
    "alibi per batch": (True, (-1, -1), 0.0, "batch", False),
    "sinks": (False, (-1, -1), 0.0, False, True),
    "gemma 2 (softcap, window, causal)": (True, (16, -1), 5.0, False, False),
    "gpt-oss (sinks, window, causal)": (True, (9, -1), 0.0, False, True),
    "everything": (True, (20, -1), 4.0, True, True),
}
VARLEN_VARIANTS = {"causal": (True, (-1, -1), 0.0, False, False)}


def _extras(name, B, H, device):
    causal, window, softcap, alibi, sinks = VARIANTS.get(name) or VARLEN_VARIANTS[name]
    g = torch.Generator().manual_seed(len(name))
    slopes = None
    if alibi:
        slopes = (torch.rand((B, H) if alibi == "batch" else (H,), generator=g) * 0.5).to(device)
    sink = (torch.randn(H, generator=g) * 2).to(device) if sinks else None
    return dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                sinks=sink)


def _grads(fn, tensors, do, dtype=None):
    """fn's output and the gradients of (q, k, v[, sinks]) for the output gradient ``do``; the
    sinks stay fp32 (or become fp64 with ``dtype``)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors[:3]]
    if len(tensors) == 4:
        leaves.append(tensors[3].detach().to(dtype or torch.float32).requires_grad_())
    o = fn(*leaves)
    return o, torch.autograd.grad(o, leaves, do.to(o.dtype))


def _check(got_o, got, ref_o, ref, base_o, base, label):
    assert_close_2x(got_o, ref_o, base_o, name=f"O {label}")
    for name, g, r, b in zip(("dq", "dk", "dv", "dsinks"), got, ref, base):
        assert g.dtype == b.dtype and g.shape == r.shape, (name, g.dtype, g.shape)
        assert not torch.isnan(g).any(), f"{name} has NaN (an element never written?)"
        floor = max(1e-5, torch.finfo(g.dtype).eps * r.abs().max().item())
        assert_close_2x(g, r, b, name=f"{label} {name}", atol=floor)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_the_reference(shape, name, dtype, poisoned_allocations):
    B, H, H_kv, N_q, N_k, D = shape
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k, v = (fresh_randn(B, H_kv, N_k, D, dtype=dtype) for _ in range(2))
    do = fresh_randn(B, H, N_q, D, dtype=dtype)
    kw = _extras(name, B, H, q.device)
    sinks = kw.pop("sinks")
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)

    def ours(*t, return_lse=False):
        return flash_attn_v2(*t[:3], kw["causal"], None, window_size=kw["window_size"],
                             softcap=kw["softcap"], alibi_slopes=kw["alibi_slopes"],
                             sinks=t[3] if len(t) == 4 else None, return_lse=return_lse)

    def reference(compute_dtype):
        def f(*t):
            return attention_variants(*t[:3], sinks=t[3] if len(t) == 4 else None,
                                      compute_dtype=compute_dtype, **kw)
        return f

    _compare(ours, reference, tensors, do, kw, name)


def _compare(ours, reference, tensors, do, kw, label):
    """O and every gradient of ``ours`` under the 2x rule against fp64 autograd of
    ``reference(None)``, with ``reference(dtype)`` as the baseline; with fp16 or bf16 inputs
    the sinks' gradient by ``_check_half_dsinks``. ``kw``: the variant's keywords but sinks."""
    dtype = tensors[0].dtype
    o, got = _grads(ours, tensors, do)
    ref_o, ref = _grads(reference(None), tensors, do, torch.float64)
    base_o, base = _grads(reference(dtype), tensors, do)
    if len(tensors) == 3 or dtype == torch.float32:
        _check(o, got, ref_o, ref, base_o, base, label)
        return
    sinks = tensors[3]
    _check(o, got[:3], ref_o, ref[:3], base_o, base[:3], label)
    with torch.no_grad():
        o_stored, lse = ours(*tensors, return_lse=True)
        ref_lse = attention_variants(*(t.double() for t in tensors[:3]), sinks=sinks.double(),
                                     return_lse=True, **kw)[1]
    _check_half_dsinks(got[3], ref[3], sinks, do, o_stored, lse, ref_o.detach(), ref_lse)


def _check_half_dsinks(dsinks, ref, sinks, do, o_stored, lse, ref_o, ref_lse):
    """The sinks' gradient with fp16 or bf16 inputs, in two parts.

    d sink_h = −Σ_i P_sink,i (dO_i · O_i), P_sink,i = e^{sink_h − lse_i}: a sum over all B·N_q
    rows of the O the forward stored, rounded to q's dtype. A 2x rule against PyTorch's
    same-precision gradient compares two sums of rounding errors with random signs, and it
    failed on fresh inputs (2.05x and 2.34x in one run) with every other gradient well inside.
    So, with O and the lse themselves checked elsewhere (O under the 2x rule above):

    1. the backward's own arithmetic: the gradient equals the formula evaluated in float64 on
       the forward's stored O and lse (only the kernels' fp32 sums may differ);
    2. what the stored O and lse carry into it: the distance from the float64 reference stays
       inside the first-order bound Σ_i P_sink,i (Σ_d |dO_id| |ΔO_id| + |Δlse_i| |delta_i|),
       with ΔO and Δlse the stored values' errors against float64.
    """
    p_sink = torch.exp(sinks.double()[None, :, None] - lse.double())  # (B, H, N_q)
    delta = (do.double() * o_stored.double()).sum(-1)
    formula = -(p_sink * delta).sum((0, 2))
    own = (dsinks.double() - formula).abs().max().item()
    print(f"dsinks against the formula on the stored O and lse: {own:.2g}")
    assert own <= 1e-5 * (1 + formula.abs().max().item()), own
    d_o = (o_stored.double() - ref_o).abs()
    d_lse = torch.nan_to_num(lse.double() - ref_lse, nan=0.0).abs()
    bound = (p_sink * ((do.double().abs() * d_o).sum(-1) + d_lse * delta.abs())).sum((0, 2))
    err = (dsinks.double() - ref).abs()
    print(f"dsinks against float64: {err.max().item():.2g} (bound {bound.max().item():.2g})")
    assert torch.all(err <= 1.01 * bound + 1e-5 * (1 + ref.abs())), (err, bound)


@pytest.mark.parametrize("window", [(-1, -1), (6, 2), (0, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_combination_of_the_variants(causal, window):
    """window x causal x softcap x ALiBi x sinks x GQA, one odd shape, every gradient, in the
    first kernel dtype: fp32 in the interpreter, fp16 on a GPU (split by causal and window, as
    the forward's test is)."""
    B, H, H_kv, N_q, N_k, D = 1, 4, 2, 29, 41, 32
    dtype = KERNEL_DTYPES[0]
    q, k, v, do = (fresh_randn(B, h, n, D, dtype=dtype)
                   for h, n in ((H, N_q), (H_kv, N_k), (H_kv, N_k), (H, N_q)))
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(H, generator=g).to(q.device)
    sinks = torch.randn(H, generator=g).to(q.device)
    for softcap, alibi, sink in itertools.product((0.0, 2.5), (None, slopes), (None, sinks)):
        kw = dict(causal=causal, sm_scale=0.2, window_size=window, softcap=softcap,
                  alibi_slopes=alibi)
        tensors = (q, k, v) if sink is None else (q, k, v, sink)

        def ours(*t, kw=kw, return_lse=False):
            return flash_attn_v2(*t[:3], sinks=t[3] if len(t) == 4 else None,
                                 return_lse=return_lse, **kw)

        def reference(compute_dtype, kw=kw):
            def f(*t):
                return attention_variants(*t[:3], sinks=t[3] if len(t) == 4 else None,
                                          compute_dtype=compute_dtype, **kw)
            return f
        _compare(ours, reference, tensors, do, kw, f"causal={causal} window={window} "
                 f"softcap={softcap} alibi={alibi is not None} sinks={sink is not None}")


@pytest.mark.parametrize("name", ["causal", "everything", "window"])
def test_varlen_gradients_match_the_reference(name, poisoned_allocations):
    """Sequences of lengths 0 to 70 packed in one tensor: O, dq, dk, dv (and dsinks), 2x rule."""
    lens_q, lens_k = [5, 0, 37, 1, 70, 16], [9, 3, 37, 20, 33, 16]
    H, H_kv, D = 4, 2, 32
    dev = fresh_randn(1).device
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=dev)
    q = fresh_randn(sum(lens_q), H, D)
    k, v = fresh_randn(sum(lens_k), H_kv, D), fresh_randn(sum(lens_k), H_kv, D)
    do = fresh_randn(sum(lens_q), H, D)
    kw = _extras(name, len(lens_q), H, dev)
    causal, sinks = kw.pop("causal"), kw.pop("sinks")
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    args = (cu_q, cu_k, max(lens_q), max(lens_k), causal, 0.25)

    def ours(*t):
        return flash_attn_varlen(*t[:3], *args, sinks=t[3] if len(t) == 4 else None, **kw)

    def reference(compute_dtype):
        def f(*t):
            return attention_varlen(*t[:3], *args, sinks=t[3] if len(t) == 4 else None,
                                    compute_dtype=compute_dtype, **kw)
        return f
    o, got = _grads(ours, tensors, do)
    ref_o, ref = _grads(reference(None), tensors, do, torch.float64)
    base_o, base = _grads(reference(torch.float32), tensors, do)
    _check(o, got, ref_o, ref, base_o, base, f"varlen {name}")


def test_a_window_backward_skips_the_blocks_outside_the_band():
    """Keys outside the band of every row of the last query blocks are never read by their
    programs: NaN there leaves those rows' dq right (a key read under a mask would not)."""
    B, H, N, D = 1, 2, 512, 16
    q, k, v, do = (fresh_randn(B, H, N, D) for _ in range(4))
    window = (10, 0)
    q_ = q.clone().requires_grad_()
    o = flash_attn_v2(q_, k, v, window_size=window)
    (dq_ref,) = torch.autograd.grad(o, q_, do)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :256], v2[:, :, :256] = float("nan"), float("nan")
    q_ = q.clone().requires_grad_()
    o2 = flash_attn_v2(q_, k2, v2, window_size=window)
    (dq,) = torch.autograd.grad(o2, q_, do)
    torch.testing.assert_close(dq[:, :, 384:], dq_ref[:, :, 384:], atol=1e-6, rtol=1e-6)


@triton.jit
def _rows_probe(OUT, N_Q, N_K, VARIANT, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = _band_rows(pid * BLOCK_N, N_Q, N_K, VARIANT, BLOCK_N, BLOCK_M)
    tl.store(OUT + pid * 4 + 0, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


@pytest.mark.parametrize("n_q,n_k", [(64, 64), (37, 100), (100, 37), (50, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (10, 0), (5, 7), (0, 0), (-1, 20)])
@pytest.mark.parametrize("bm", [16, 32])
def test_the_dkdv_program_visits_exactly_the_rows_the_rule_names(n_q, n_k, window, bm):
    """``_band_rows`` (the kernel's) against ``masks.block_row_range`` and the brute-force mask:
    it visits every row that sees a key of its block (no more, but for rounding down to a
    block of rows), and runs unmasked only rows that see every key of a whole block."""
    bn = 16
    vis = masks.visible(n_q, n_k, window)
    n_blocks = triton.cdiv(n_k, bn)
    out = torch.zeros(n_blocks * 4, dtype=torch.int32, device=fresh_randn(1).device)
    _rows_probe[(n_blocks,)](out, n_q, n_k, variant_args(Variant(window))[0], bn, bm)
    for c, (lo, full_lo, full_hi, hi) in enumerate(out.view(-1, 4).tolist()):
        c0, c1 = c * bn, (c + 1) * bn
        rule = masks.block_row_range(c0, c1, n_q, n_k, window)
        rows = vis[:, c0:min(c1, n_k)].any(1).nonzero().flatten()
        if len(rows):
            assert (rule[0], rule[3]) == (rows.min().item(), rows.max().item() + 1)
            assert hi == rule[3] and lo == rule[0] // bm * bm, (c, (lo, hi), rule)
        else:
            assert lo >= hi, (c, lo, hi)
        assert lo <= full_lo <= full_hi <= hi and (full_hi - full_lo) % bm == 0
        if full_hi > full_lo:  # unmasked rows see every key of a block that is all real keys
            assert c1 <= n_k and vis[full_lo:full_hi, c0:c1].all()
            assert rule[1] <= full_lo and full_hi <= rule[2]
        all_rows = vis[:, c0:min(c1, n_k)].all(1).nonzero().flatten()
        if len(all_rows) and c1 <= n_k:
            assert (rule[1], rule[2]) == (all_rows.min().item(), all_rows.max().item() + 1)
            # what runs masked that could run unmasked: less than a block on each side
            assert full_lo - rule[1] < bm and rule[2] - full_hi < 2 * bm


def test_the_dense_path_serves_a_window_that_is_plain_causal():
    """window_size=(-1, 0) is causal: the dense kernels, the same numbers as causal=True."""
    q, k, v = (fresh_randn(1, 2, 33, 32) for _ in range(3))
    torch.testing.assert_close(flash_attn_v2(q, k, v, window_size=(-1, 0)),
                               flash_attn_v2(q, k, v, causal=True), atol=0, rtol=0)
    with pytest.raises(ValueError, match="impl"):
        flash_attn_v2(q, k, v, window_size=(4, 0), impl="tma")


def _packed(lens_q, lens_k, H=2, H_kv=1, D=32):
    dev = fresh_randn(1).device
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=dev)
    q = fresh_randn(sum(lens_q), H, D)
    k, v = fresh_randn(sum(lens_k), H_kv, D), fresh_randn(sum(lens_k), H_kv, D)
    return q, k, v, cu_q, cu_k


class _Spy:
    """A kernel's stand-in: records the data pointers of the tensors each launch gets by
    position, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.pointers, self.arg_names = kernel, [], kernel.arg_names

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.pointers.append([a.data_ptr() for a in args if isinstance(a, torch.Tensor)])
            return self.kernel[grid](*args, **meta)
        return launch


@pytest.mark.parametrize("views", [False, True], ids=["contiguous", "views of one qkv"])
def test_the_varlen_backward_reads_and_writes_the_packed_layout(views, monkeypatch,
                                                                poisoned_allocations):
    """dq, dk, dv come back (total, H, D) contiguous, and right under the 2x rule (window,
    softcap, ALiBi, sinks, GQA, a padded head dim). Contiguous inputs reach the kernels as they
    are: each kernel gets q's, k's, v's, o's and dO's own memory and writes the gradients
    returned, so no heads-first copy is made. Views with a unit last stride (q, k, v of one fused
    qkv tensor, dO a slice) give the same gradients."""
    lens_q, lens_k = [5, 0, 37, 1, 70], [9, 3, 37, 20, 44]  # one total: a fused qkv fits
    H, H_kv, D = 4, 2, 40
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, H, H_kv, D)
    do = fresh_randn(*q.shape)
    if views:  # the same numbers at other strides: rows of (H + 2·H_kv)·D and of 2·D elements
        qkv = torch.cat([q, k, v], 1)
        q, k, v = qkv[:, :H], qkv[:, H:H + H_kv], qkv[:, H + H_kv:]
        do = torch.cat([do, fresh_randn(*do.shape)], -1)[..., :D]
        assert not any(t.is_contiguous() for t in (q, k, v, do))
    g = torch.Generator().manual_seed(3)
    slopes = (torch.rand(len(lens_q), H, generator=g) * 0.5).to(q.device)
    sinks = (torch.randn(H, generator=g) * 2).to(q.device)
    window, softcap, sm_scale = (20, 0), 4.0, 0.25
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    variant = Variant(window, softcap, slopes, sinks)
    o, lse = forward_variants_varlen(q, k, v, *args, sm_scale, variant)
    spies = {(module, name): _Spy(getattr(module, name)) for module, name in (
        (flash_bwd, "_bwd_preprocess_kernel"), (flash_variants_bwd, "_bwd_dkdv_variants_kernel"),
        (flash_variants_bwd, "_bwd_dq_variants_kernel"))}
    for (module, name), spy in spies.items():
        monkeypatch.setattr(module, name, spy)
    got = backward_variants_varlen(do, q, k, v, o, lse, *args, sm_scale, variant)
    for name, grad, t in zip(("dq", "dk", "dv"), got, (q, k, v)):
        assert grad.shape == t.shape and grad.is_contiguous(), (name, grad.shape, grad.stride())
    (pre,), (kv,), (qs,) = (spy.pointers for spy in spies.values())
    if not views:  # (O, DO, LSE, ...), (Q, K, V, DO, LSE2, Delta, DK, DV, ...), (..., DQ, ...)
        ptr = [t.data_ptr() for t in (q, k, v, o, do, *got[:3])]
        assert pre[:3] == [ptr[3], ptr[4], lse.data_ptr()]
        assert kv[:4] == ptr[:3] + ptr[4:5] and kv[6:8] == ptr[6:8]
        assert qs[:4] == ptr[:3] + ptr[4:5] and qs[6] == ptr[5]

    kw = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)

    def reference(compute_dtype):
        def f(*t):
            return attention_varlen(*t[:3], *args, False, sm_scale, sinks=t[3],
                                    compute_dtype=compute_dtype, **kw)
        return f
    ref_o, ref = _grads(reference(None), (q, k, v, sinks), do, torch.float64)
    base_o, base = _grads(reference(torch.float32), (q, k, v, sinks), do)
    _check(o, got, ref_o, ref, base_o, base, "varlen in place" + " (views)" * views)


def test_varlen_input_errors_name_the_argument():
    q, k, v, cu_q, cu_k = _packed([3, 5], [4, 6])

    def call(**kw):  # validate=True: the offsets' values are checked on every device
        args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                    validate=True)
        args.update(kw)
        return flash_attn_varlen(kw.pop("q", q), k, v, **args)

    bad = [
        (dict(cu_seqlens_q=cu_q + 1), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_k=cu_k.flip(0)), ValueError, "cu_seqlens_k"),
        (dict(cu_seqlens_q=cu_q.long()), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=cu_q[:2]), ValueError, "cu_seqlens_k"),
        (dict(max_seqlen_q=4), ValueError, "max_seqlen_q"),
        (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32, device=q.device)),
         ValueError, "cu_seqlens_k ends at 9"),
        (dict(window_size=(-3, 0)), ValueError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(sinks=torch.zeros(3, device=q.device)), ValueError, "sinks"),
        (dict(alibi_slopes=torch.zeros(2, 3, device=q.device)), ValueError, "alibi_slopes"),
    ]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            call(**kw)
    if q.device.type == "cpu":  # by default the values are checked where that is free
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
            flash_attn_varlen(q, k, v, cu_q + 1, cu_k, 5, 6)
    with pytest.raises(ValueError, match="k and v"):
        flash_attn_varlen(q, k, v[:-1], cu_q, cu_k, 5, 6)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        flash_attn_varlen(q[None], k, v, cu_q, cu_k, 5, 6)


def test_the_operators_pass_opcheck_and_compile():
    """The four operators: schemas, fake implementations, autograd registration (opcheck), and
    torch.compile(fullgraph=True) through the forward and backward of each function."""
    q, k, v = (fresh_randn(1, 2, 21, 32) for _ in range(3))
    sinks, slopes = fresh_randn(2), fresh_randn(2).abs()
    args = (q, k, v, 0.2, 5, 0, 2.0, slopes, sinks)
    torch.library.opcheck(torch.ops.course.flash_attn_variants_fwd.default, args)
    o, lse = torch.ops.course.flash_attn_variants_fwd(*args)
    torch.library.opcheck(torch.ops.course.flash_attn_variants_bwd.default,
                          (torch.randn_like(o), q, k, v, o, lse, *args[3:]))
    pq, pk, pv, cu_q, cu_k = _packed([7, 0, 12], [9, 4, 12])
    vargs = (pq, pk, pv, cu_q, cu_k, 12, 12, 0.2, -1, 0, 0.0, None, sinks)
    torch.library.opcheck(torch.ops.course.flash_attn_varlen_fwd.default, vargs)
    po, plse = torch.ops.course.flash_attn_varlen_fwd(*vargs)
    torch.library.opcheck(torch.ops.course.flash_attn_varlen_bwd.default,
                          (torch.randn_like(po), pq, pk, pv, po, plse, *vargs[3:]))

    def loss(q, k, v, sinks):
        o = flash_attn_v2(q, k, v, True, window_size=(6, -1), softcap=3.0, sinks=sinks)
        return (o * o).sum()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
