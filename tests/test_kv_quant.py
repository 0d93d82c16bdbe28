"""An 8-bit KV cache (int8, FP8 e4m3) with one scale per token and head: ``course_lib.kvquant``,
and ``flash_decode`` / ``paged_decode`` dequantising it inside the split kernel.

The kernel's answer on a quantized cache is checked against the fp32 reference on the
*dequantised* cache (the same numbers the kernel multiplies); the error against the cache before
quantization is printed and held to a bound derived from the quantization errors themselves.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import course_lib
from course_lib.kvcache import contiguous_to_pages
from course_lib.kvquant import QMAX, dequantize_kv, kv_bytes_per_token, quantize_kv
from course_lib.ops import decode as opd
from course_lib.ops import flash_decode, paged_decode, plan_decode
from course_lib.reference import attention_variants, decode_reference
from course_lib.testing import (
    assert_close_2x,
    attention_same_precision,
    errors,
    fresh_randn,
    variants_same_precision,
)

E4M3 = torch.float8_e4m3fn
FORMATS = [torch.int8, E4M3]
Q_DTYPE = torch.float32 if course_lib.DEVICE == "cpu" else torch.float16


def _fmt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(*shape, seed=0):
    """Unit normal rows with a few large entries (the outliers a per-token scale must cover)."""
    x = fresh_randn(*shape, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    spikes = (torch.rand(shape, generator=gen) < 0.01).to(x.device)
    return x + spikes * 8.0


# ------------------------------------------------------------------------ the quantization

def test_int8_round_trip_is_within_half_a_step():
    x = _rows(2, 3, 97, 40)
    x_q, scale = quantize_kv(x, torch.int8)
    assert x_q.dtype == torch.int8 and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert int(x_q.abs().max()) == 127 and int(x_q.min()) >= -127  # symmetric: no -128
    assert torch.equal(x_q.abs().amax(-1), torch.full_like(scale, 127, dtype=torch.int8))
    err = (dequantize_kv(x_q, scale) - x).abs()
    step = scale[..., None]
    print(f"int8: max err {err.max():.2g} = {float((err / step).max()):.3f} of a step, "
          f"mean err {err.mean():.2g}")
    assert (err <= step * (0.5 + 2 ** -16)).all()  # round to nearest, then fp32's own rounding


def test_e4m3_round_trip_is_within_its_relative_step():
    x = _rows(2, 3, 97, 40, seed=4)
    x_q, scale = quantize_kv(x, E4M3)
    assert x_q.dtype == E4M3 and scale.shape == x.shape[:-1]
    assert torch.equal(x_q.float().abs().amax(-1), torch.full_like(scale, QMAX[E4M3]))
    x_hat = dequantize_kv(x_q, scale)
    err = (x_hat - x).abs()
    # 3 mantissa bits: 2^-4 of the value; e4m3's subnormals (below 2^-6) step by 2^-9
    bound = torch.maximum(x.abs() * 2 ** -4, scale[..., None] * 2 ** -10) * (1 + 2 ** -16)
    rel = err / x.abs().clamp_min(1e-30)
    print(f"e4m3: max err {err.max():.2g}, max relative err {float(rel.max()):.3f} "
          f"(2^-4 = {2 ** -4}), mean err {err.mean():.2g}")
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_a_zero_row_gets_scale_one(dtype):
    x = fresh_randn(2, 5, 8)
    x[1, 3] = 0.0
    x_q, scale = quantize_kv(x, dtype)
    assert scale[1, 3] == 1.0 and not x_q[1, 3].float().any()
    assert not dequantize_kv(x_q, scale)[1, 3].any()
    assert (scale > 0).all() and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_pages_quantize_as_the_contiguous_cache_does(dtype):
    """One scale per token and head in either layout: quantizing pages is paging the quantized
    cache (values and scales)."""
    k = fresh_randn(2, 3, 37, 16)
    k_q, k_scale = quantize_kv(k, dtype)
    pages, _ = contiguous_to_pages(k, block_size=8, generator=torch.Generator().manual_seed(2))
    pages_q, pages_scale = quantize_kv(pages, dtype)
    assert pages_scale.shape == pages.shape[:-1]  # (num_blocks, block_size, H_kv)
    real = _page(torch.ones(k.shape[:-1], device=k.device), 8, seed=2) > 0  # not padding
    assert int(real.sum()) == k.shape[:-1].numel()
    paged_q = _page(k_q, 8, seed=2)
    assert torch.equal(pages_q[real].view(torch.uint8), paged_q[real].view(torch.uint8))
    assert torch.equal(pages_scale[real], _page(k_scale, 8, seed=2)[real])


def test_bytes_per_token():
    H_kv, D = 8, 128
    assert kv_bytes_per_token(H_kv, D, torch.float16) == 4 * H_kv * D == 4096
    assert kv_bytes_per_token(H_kv, D, torch.bfloat16) == 4096
    assert kv_bytes_per_token(H_kv, D, torch.float32) == 8 * H_kv * D
    for dtype in FORMATS:
        assert kv_bytes_per_token(H_kv, D, dtype) == 2 * H_kv * D + 2 * 4 * H_kv == 2112
    ratio = kv_bytes_per_token(H_kv, D, torch.int8) / kv_bytes_per_token(H_kv, D, torch.float16)
    print(f"an 8-bit cache is {ratio:.3f} of fp16's bytes at D {D}")
    assert ratio == pytest.approx(0.5 + 2 / D)


def test_quantize_names_its_arguments():
    with pytest.raises(ValueError, match="dtype must be torch.int8 or torch.float8_e4m3fn"):
        quantize_kv(fresh_randn(2, 8), torch.float16)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_kv(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale must have x_q's shape"):
        dequantize_kv(torch.zeros(2, 8, dtype=torch.int8), torch.ones(8))
    with pytest.raises(TypeError, match="x_q must be an int8 or float8_e4m3fn"):
        dequantize_kv(torch.zeros(2, 8), torch.ones(2))


@triton.jit
def _convert_kernel(X, Y16, Y32, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y16 + offs, x.to(tl.float16))
    tl.store(Y32 + offs, x.to(tl.float32))


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_the_kernels_conversion_of_every_8_bit_value_is_exact(dtype):
    """The split kernel converts loaded int8 and e4m3 tiles to q's dtype: every finite code of
    both formats is exact in fp16 and fp32, here as on a GPU. (The interpreter's fp32 -> e4m3
    cast rounds wrongly, ``kernels/flash_fp8.py``'s ``_e4m3_grid``; the conversions *from* 8
    bits are right. Its e4m3 NaN code reads as 480: a quantized cache holds no NaN.)"""
    dev = course_lib.DEVICE
    if dtype == torch.int8:
        codes = torch.arange(-127, 128, dtype=torch.int16).to(torch.int8)
    else:
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(E4M3)
        codes = codes[~codes.float().isnan()]  # 254 finite codes, ±0 among them
    codes = torch.cat([codes, codes[:256 - codes.numel()]]).to(dev)  # 256: a power of two
    y16 = torch.empty(256, dtype=torch.float16, device=dev)
    y32 = torch.empty(256, dtype=torch.float32, device=dev)
    _convert_kernel[(1,)](codes, y16, y32, N=256)
    assert torch.equal(y32, codes.float()) and torch.equal(y16, codes.to(torch.float16))
    assert torch.equal(y16.float(), y32)  # exact in fp16 too


# ------------------------------------------------------------------- the kernels, quantized

CASES = [  # B, H, H_kv, N_q, N_max, D, lengths
    (3, 4, 2, 1, 97, 32, [97, 17, 1]),   # GQA group of 2, ragged lengths
    (3, 8, 2, 3, 97, 32, [1, 17, 97]),   # group of 4, 3 causal queries (some rows see no key)
]


def _case_id(c):
    return "B{}H{}kv{}q{}N{}D{}".format(*c[:6])


def _page(x, block_size, seed):
    """Pages of a contiguous (B, H_kv, N, ...) tensor of any dtype, laid out by a random block
    table as ``contiguous_to_pages`` lays them (the same seed: the same table): a cache of
    8-bit values (D last) or its scales (no D: a dim of 1 is paged and dropped)."""
    scales = x.ndim == 3
    pages, _ = contiguous_to_pages(x[..., None] if scales else x, block_size=block_size,
                                   generator=torch.Generator().manual_seed(seed))
    return pages[..., 0] if scales else pages


def _quantized(B, H, H_kv, N_q, N_max, D, lengths, fmt, seed=0):
    """q, the unquantised k and v, lens; the quantized cache (k_q, k_scale, v_q, v_scale) with
    the scales past each sequence's length NaN (never read); the dequantised k̂, v̂."""
    q = fresh_randn(B, H, N_q, D, dtype=Q_DTYPE, seed=seed)
    k, v = _rows(B, H_kv, N_max, D, seed=seed + 2), _rows(B, H_kv, N_max, D, seed=seed + 4)
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    (k_q, k_scale), (v_q, v_scale) = quantize_kv(k, fmt), quantize_kv(v, fmt)
    k_hat, v_hat = dequantize_kv(k_q, k_scale), dequantize_kv(v_q, v_scale)
    for b, n in enumerate(lengths):
        k_scale[b, :, n:] = float("nan")
        v_scale[b, :, n:] = float("nan")
    return q, k, v, lens, (k_q, k_scale, v_q, v_scale), k_hat, v_hat


def _call(q, cache, lens, paged, block_size=8, **kw):
    """(o, lse) of flash_decode, or of paged_decode on the same cache and scales paged."""
    k_q, k_scale, v_q, v_scale = cache
    if not paged:
        return flash_decode(q, k_q, v_q, lens, k_scale=k_scale, v_scale=v_scale,
                            return_lse=True, **kw)
    seed = 9
    pages = [_page(t, block_size, seed) for t in cache]
    _, table = contiguous_to_pages(k_scale[..., None], block_size=block_size,
                                   generator=torch.Generator().manual_seed(seed))
    return paged_decode(q, pages[0], pages[2], table, lens, k_scale=pages[1], v_scale=pages[3],
                        return_lse=True, **kw)


def _per_sequence(fn, q, k, v, lens, **kw):
    """(o, lse) of ``fn`` (a reference's signature) on each sequence's first L_b keys."""
    outs, lses = [], []
    for b, n in enumerate(lens.tolist()):
        o, lse = fn(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=True,
                    return_lse=True, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(o, lse, q, k_hat, v_hat, lens, name, **variants):
    """o and lse against the fp32 reference on the dequantised cache (the 2x rule)."""
    if variants:
        ref_o, ref_lse = _per_sequence(attention_variants, q.float(), k_hat, v_hat, lens,
                                       **variants)
        base = _per_sequence(variants_same_precision, q, k_hat.to(q.dtype), v_hat.to(q.dtype),
                             lens, **variants)[0]
    else:
        ref_o, ref_lse = decode_reference(q.float(), k_hat, v_hat, lens, return_lse=True)
        base = torch.cat([attention_same_precision(q[b:b + 1], k_hat[b:b + 1, :, :n].to(q.dtype),
                                                   v_hat[b:b + 1, :, :n].to(q.dtype), causal=True)
                          for b, n in enumerate(lens.tolist())])
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any(), f"{name}: an output element was never written (or NaN)"
    assert not torch.isnan(lse).any(), f"{name}: an lse element was never written (or NaN)"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{name}: rows that see no key"
    assert_close_2x(o, ref_o, base, name=f"{name} O")
    assert_close_2x(lse, ref_lse, ref_lse, name=f"{name} lse", atol=1e-4)
    return ref_o


def _quantization_bound(q, k, v, k_hat, v_hat, lens, sm_scale):
    """A bound on |o(k̂, v̂) − o(k, v)| for each row and column. A row's weights move by factors
    within e^{±2δ}, δ its largest change of a score sm_scale·q·k, so Σ|p̂ − p| <= e^{2δ} − 1;
    since both sum to 1, Σ(p̂ − p)·v = Σ(p̂ − p)·(v − c) for the middle c of v's range. Hence
    |o(k̂, v̂) − o(k, v)| <= max|v̂ − v| + (e^{2δ} − 1) · (max v − min v) / 2, per column."""
    group = q.shape[1] // k.shape[1]
    keys = torch.arange(k.shape[2], device=k.device)
    seen = (keys[None, :] < lens[:, None])[:, None, :, None]  # (B, 1, N, 1): keys in use
    dk = torch.where(seen, k_hat - k, 0.0).repeat_interleave(group, 1)
    delta = (q.float() @ dk.transpose(-1, -2)).abs().amax(-1) * sm_scale  # (B, H, N_q)
    dv = torch.where(seen, v_hat - v, 0.0).abs().amax(2)  # (B, H_kv, D)
    half_range = (torch.where(seen, v, -math.inf).amax(2)
                  - torch.where(seen, v, math.inf).amin(2)) / 2
    dv, half_range = (t.repeat_interleave(group, 1)[:, :, None] for t in (dv, half_range))
    return dv + torch.expm1(2 * delta[..., None]) * half_range  # (B, H, N_q, D)


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating-point buffer ``torch.empty`` and ``torch.empty_like`` allocate (partials,
    output, lse) starts as NaN, and no kept plan's buffers are reused."""
    def poisoning(allocate):
        def empty(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return empty

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))
    opd.forget_plans()
    yield
    opd.forget_plans()


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_quantized_cache_matches_the_reference_on_its_dequantised_values(
        case, fmt, paged, num_splits, poisoned):
    q, k, v, lens, cache, k_hat, v_hat = _quantized(*case, fmt)
    o, lse = _call(q, cache, lens, paged, num_splits=num_splits)
    name = f"{_fmt(fmt)} {'paged' if paged else 'contiguous'} {num_splits} splits"
    _check(o, lse, q, k_hat, v_hat, lens, name)
    # against the cache before quantization: the error quantization makes, within its bound
    ref = decode_reference(q.float(), k, v, lens)
    err_max, err_mean = errors(o, ref)
    bound = _quantization_bound(q, k, v, k_hat, v_hat, lens, case[5] ** -0.5)
    print(f"{name}: vs the unquantised cache max err {err_max:.2g}, mean {err_mean:.2g} "
          f"(bounds from the quantization errors: largest {bound.max():.2g}, mean "
          f"{bound.mean():.2g})")
    rounding = 1e-5 if q.dtype == torch.float32 else 4e-3  # (o in fp16 on a GPU)
    assert ((o.float() - ref).abs() <= bound + rounding).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt)
def test_a_window_over_a_quantized_cache(fmt, paged, poisoned):
    """A sliding window with the sinks (lesson 15's variants) reads only the band's keys and
    scales; one split and three."""
    B, H, H_kv, N_q, N_max, D = 3, 4, 2, 3, 97, 32
    q, k, v, lens, cache, k_hat, v_hat = _quantized(B, H, H_kv, N_q, N_max, D, [97, 17, 1], fmt,
                                                    seed=5)
    kw = dict(window_size=(13, 0), sinks=fresh_randn(H, seed=3))
    for num_splits in (1, 3):
        o, lse = _call(q, cache, lens, paged, num_splits=num_splits, **kw)
        _check(o, lse, q, k_hat, v_hat, lens, f"window {_fmt(fmt)} {num_splits} splits", **kw)


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt)
def test_fp16_queries_over_a_quantized_cache(fmt, poisoned):
    """q in fp16 (the GPU's dtype, bf16 too there): tiles converted to fp16, o in fp16."""
    q, k, v, lens, cache, k_hat, v_hat = _quantized(*CASES[1], fmt, seed=7)
    q = q.half()
    for paged in (False, True):
        o, lse = _call(q, cache, lens, paged, num_splits=2)
        _check(o, lse, q, k_hat, v_hat, lens, f"fp16 q, {_fmt(fmt)}, paged {paged}")


def test_a_planned_quantized_step(poisoned):
    """plan_decode of an 8-bit cache: every run takes its scales; new scales, new answers."""
    q, k, v, lens, cache, k_hat, v_hat = _quantized(*CASES[0], torch.int8, seed=11)
    k_q, k_scale, v_q, v_scale = cache
    plan = plan_decode(q, k_q, v_q, num_splits=2, k_scale=k_scale, v_scale=v_scale)
    for step in range(2):
        o, lse = plan.run(q, k_q, v_q, lens, return_lse=True, k_scale=k_scale, v_scale=v_scale)
        _check(o, lse, q, k_hat, v_hat, lens, f"planned step {step}")
        k_scale, v_scale = k_scale * 2, v_scale * 0.5  # another cache's scales
        k_hat, v_hat = k_hat * 2, v_hat * 0.5
    with pytest.raises(ValueError, match="k_scale is required"):
        plan.run(q, k_q, v_q, lens)
    with pytest.raises(ValueError, match="make a new plan"):
        plan.run(q, k_hat, v_hat, lens)  # an fp32 cache for a plan of an int8 one


def test_the_scales_are_free_arguments_of_the_bound_launch(monkeypatch, request):
    """A stand-in for the bound split kernel records the launches (the interpreter binds none):
    a second quantized call with other scale tensors repeats the plan's bound launch, the
    scales' addresses and strides after VARIANT; a plain call on a cache of q's dtype takes
    the 15 arguments it took before; the two are different plans."""
    from course_lib.kernels import decode as kd

    launched, bound = [], []
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: bound.append(kw) or [
        lambda *p: launched.append(p)])
    opd.forget_plans()
    request.addfinalizer(opd.forget_plans)  # the stand-in's launches must not outlive the test
    q, k, v, lens, cache, k_hat, v_hat = _quantized(*CASES[0], torch.int8)
    k_q, k_scale, v_q, v_scale = cache
    flash_decode(q, k_q, v_q, lens, k_scale=k_scale, v_scale=v_scale)
    assert len(bound) == 1 and bound[0]["kv_scales"] == (k_scale, v_scale)
    ks2, vs2 = k_scale.clone(), v_scale[..., :k_q.shape[2]].clone()  # the same layout
    flash_decode(q, k_q, v_q, lens, k_scale=ks2, v_scale=vs2)
    assert len(bound) == 1, "new scales bound anew"
    assert launched[-1][15:] == (ks2.data_ptr(), vs2.data_ptr(), *ks2.stride(), *vs2.stride())
    wide = torch.full((*k_scale.shape[:2], 2 * k_scale.shape[2]), float("nan"),
                      device=k_scale.device)
    wide[..., :k_scale.shape[2]] = k_scale  # a strided view: other strides, still taken anew
    flash_decode(q, k_q, v_q, lens, k_scale=wide[..., :k_scale.shape[2]], v_scale=vs2)
    assert len(bound) == 1 and launched[-1][17:20] == wide.stride()
    plain = k_hat.to(q.dtype), v_hat.to(q.dtype)
    flash_decode(q, *plain, lens)  # a cache in q's dtype: a plan of its own
    flash_decode(q, *plain, lens)  # ... whose bound launch takes 15 arguments
    assert len(bound) == 2 and bound[1]["kv_scales"] is None and len(launched[-1]) == 15


# ------------------------------------------------------------------------------ bad input

def _bad_scales():
    """(what to change, error, message): every bad scale argument, named."""
    return [
        (dict(k_scale=None, v_scale=None), ValueError, "k_scale is required with a torch.int8"),
        (dict(v_scale=None), ValueError, "v_scale is required"),
        (dict(k_scale="shape"), ValueError, r"k_scale must have shape \(2, 2, 40\)"),
        (dict(v_scale="half"), TypeError, "v_scale must be float32"),
        (dict(k_scale="list"), TypeError, "k_scale must be a torch.Tensor"),
        (dict(v="e4m3"), TypeError, "k and v must share one dtype"),
        (dict(v="float"), TypeError, r"v has dtype torch.float(16|32); use int8 or float8_e4m3fn"),
        (dict(cache="fp16"), ValueError, "k_scale is for an int8 or float8_e4m3fn"),
    ]


@pytest.mark.parametrize("change, error, message", _bad_scales(),
                         ids=[f"{next(iter(c[0]))}-{i}" for i, c in enumerate(_bad_scales())])
def test_bad_scales_name_the_argument(change, error, message):
    q, k, v, lens, cache, _, _ = _quantized(2, 4, 2, 1, 40, 16, [40, 9], torch.int8)
    k_q, k_scale, v_q, v_scale = cache
    made = {"shape": lambda t: t[:, :, :-1], "half": lambda t: t.half(),
            "list": lambda t: t.tolist()}
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    for name in ("k_scale", "v_scale"):
        if name in change:
            kw[name] = None if change[name] is None else made[change[name]](kw[name])
    if "v" in change:
        v_q = quantize_kv(v, E4M3)[0] if change["v"] == "e4m3" else v.to(q.dtype)
    if change.get("cache") == "fp16":
        k_q, v_q = k.to(q.dtype), v.to(q.dtype)
    for call in (lambda: flash_decode(q, k_q, v_q, lens, **kw),
                 lambda: flash_decode(q, k_q, v_q, lens, **kw),  # a repeat checks it too
                 lambda: plan_decode(q, k_q, v_q, **kw)):
        with pytest.raises(error, match=message):
            call()


def test_paged_scales_must_be_paged_and_on_the_caches_device():
    q, k, v, lens, cache, _, _ = _quantized(2, 4, 2, 1, 40, 16, [40, 9], E4M3)
    k_q, k_scale, v_q, v_scale = cache
    pages = [_page(t, 8, seed=1) for t in cache]
    _, table = contiguous_to_pages(k_scale[..., None], block_size=8,
                                   generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"k_scale must have shape \(10, 8, 2\) \(k_pages'"):
        paged_decode(q, pages[0], pages[2], table, lens, k_scale=k_scale, v_scale=pages[3])
    with pytest.raises(ValueError, match="v_scale is required with a torch.float8_e4m3fn "
                                         "v_pages"):
        paged_decode(q, pages[0], pages[2], table, lens, k_scale=pages[1])
    # another device: the CPU's tensors beside a GPU's; on the CPU a meta tensor (which shares
    # the CPU's get_device() -1, the plans' key: no kept plan may answer first)
    other = "meta" if course_lib.DEVICE == "cpu" else "cpu"
    opd.forget_plans()
    with pytest.raises(ValueError, match=f"k_scale is on {other}"):
        flash_decode(q, k_q, v_q, lens, k_scale=k_scale.to(other), v_scale=v_scale)


# ------------------------------------------------------------------------------ GPU sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("N_q", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt)
def test_gpu_quantized_cache_long_ragged_batch(fmt, N_q, paged, dtype):
    """The course's decode shape (H 32, H_kv 8, D 128) over caches up to 32k keys, the split
    count and tiles the plan picks for the GPU; with a window too."""
    lengths = [32768, 4097, 1, 20000]
    q, k, v, lens, cache, k_hat, v_hat = _quantized(4, 32, 8, N_q, 32768, 128, lengths, fmt)
    q = q.to(dtype)
    o, lse = _call(q, cache, lens, paged, block_size=16)
    _check(o, lse, q, k_hat, v_hat, lens, f"GPU {_fmt(fmt)} {dtype}")
    kw = dict(window_size=(1024, 0))
    o, lse = _call(q, cache, lens, paged, block_size=16, **kw)
    _check(o, lse, q, k_hat, v_hat, lens, f"GPU window {_fmt(fmt)} {dtype}", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt)
def test_gpu_planned_quantized_steps_repeat_the_bound_launch_and_replay(fmt, monkeypatch):
    """A plan of an 8-bit cache on the GPU: later steps, with new q and new scale tensors of the
    same layout, repeat the bound launch (the scales' addresses taken anew) and give Triton's
    own launch's bits; a captured step replays in a CUDA graph."""
    from course_lib import _launch

    if not _launch.FAST:
        pytest.skip(f"triton {triton.__version__} is not in SUPPORTED_TRITON")
    q, k, v, lens, cache, k_hat, v_hat = _quantized(2, 32, 8, 1, 4096, 128, [4096, 1500], fmt)
    q = q.half()
    k_q, k_scale, v_q, v_scale = cache
    plan = plan_decode(q, k_q, v_q, k_scale=k_scale, v_scale=v_scale)
    steps = [(torch.randn_like(q), k_scale * (1 + i), v_scale / (1 + i)) for i in range(3)]
    got = [plan.run(qi, k_q, v_q, lens, k_scale=ks, v_scale=vs).clone() for qi, ks, vs in steps]
    for (qi, ks, vs), o in zip(steps, got):
        ref = decode_reference(qi.float(), dequantize_kv(k_q, ks), dequantize_kv(v_q, vs), lens)
        assert float((o.float() - ref).abs().max()) < 1e-2
    monkeypatch.setattr(_launch, "FAST", False)
    slow = plan_decode(q, k_q, v_q, k_scale=k_scale, v_scale=v_scale)
    for (qi, ks, vs), o in zip(steps, got):
        torch.testing.assert_close(o, slow.run(qi, k_q, v_q, lens, k_scale=ks, v_scale=vs),
                                   rtol=0, atol=0)
    graph_plan = plan_decode(q, k_q, v_q, k_scale=k_scale, v_scale=v_scale, merge="kernel")
    q_in = steps[0][0].clone()
    graph_plan.run(q_in, k_q, v_q, lens, k_scale=k_scale, v_scale=v_scale)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_plan.run(q_in, k_q, v_q, lens, k_scale=k_scale, v_scale=v_scale)
    for qi, ks, vs in steps[:2]:
        q_in.copy_(qi)
        k_scale.copy_(ks)
        v_scale.copy_(vs)
        graph.replay()
        torch.testing.assert_close(graph_plan.out, slow.run(qi, k_q, v_q, lens, k_scale=ks,
                                                            v_scale=vs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_varlen_over_8bit_pages_equals_the_dequantised_pages(dtype):
    """A serving step over an 8-bit paged cache (``flash_attn_varlen(block_table=, k_scale=,
    v_scale=)``): prefill chunks and decode tokens, GQA, a window and a softcap, against the
    same call on the dequantised pages (fp32)."""
    import itertools

    from course_lib.kvquant import dequantize_kv, quantize_kv
    from course_lib.ops import flash_attn_varlen

    lens_q, lens_k = [5, 1, 0, 13], [9, 37, 3, 13]
    H, H_kv, D, page, num_blocks = 4, 2, 32, 8, 24
    dev = fresh_randn(1).device
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=dev)
    q = fresh_randn(sum(lens_q), H, D)
    k_pages, v_pages = (fresh_randn(num_blocks, page, H_kv, D) for _ in "kv")
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    table = order[:4 * 5].view(4, 5).to(torch.int32).to(dev)  # 5 pages of 8 keys each
    (kq, ks), (vq, vs) = quantize_kv(k_pages, dtype), quantize_kv(v_pages, dtype)
    for window, softcap in (((-1, -1), 0.0), ((6, 0), 2.0)):
        o = flash_attn_varlen(q, kq, vq, cu_q, cu_k, 13, 37, True, 0.25, window_size=window,
                              softcap=softcap, block_table=table, k_scale=ks, v_scale=vs)
        ref = flash_attn_varlen(q, dequantize_kv(kq, ks), dequantize_kv(vq, vs), cu_q, cu_k,
                                13, 37, True, 0.25, window_size=window, softcap=softcap,
                                block_table=table)
        print(f"{dtype} window {window}: max |o - o(dequantised)| "
              f"{(o - ref).abs().max().item():.1e}")
        torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="k_scale is required"):
        flash_attn_varlen(q, kq, vq, cu_q, cu_k, 13, 37, True, block_table=table, v_scale=vs)
    with pytest.raises(ValueError, match="pass block_table too"):
        flash_attn_varlen(q, q[:, :2], q[:, :2], cu_q, cu_q, 13, 13, k_scale=ks, v_scale=vs)
