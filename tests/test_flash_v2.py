"""flash_attn_v2 forward (portable and Hopper kernels) against the fp32 reference, 2x rule."""
import pytest
import torch

import course_lib
from course_lib.kernels.flash_v2_hopper import lse_rounding
from course_lib.ops.attention import IMPLS, _flash_attn_v2_forward, flash_attn_v2
from course_lib.reference import attention
from course_lib.testing import (
    KERNEL_DTYPES,
    assert_close_2x,
    attention_same_precision,
    check_extreme_logits,
    fresh_randn,
    poison_,
)

DTYPES = KERNEL_DTYPES

SHAPES = [  # B, H, H_kv, N_q, N_k, D
    (1, 2, 2, 1, 1, 64),
    (1, 2, 2, 17, 17, 32),
    (2, 2, 1, 64, 64, 64),
    (1, 4, 2, 97, 97, 64),
    (1, 2, 2, 130, 130, 16),
    (1, 2, 2, 17, 130, 64),    # N_q < N_k (a chunk of new queries against a longer cache)
    (1, 2, 1, 130, 97, 128),   # N_q > N_k: with causal, the first rows see no key
    (1, 1, 1, 64, 40, 256),
]


def _inputs(B, H, H_kv, N_q, N_k, D, dtype, scale=1.0):
    return (fresh_randn(B, H, N_q, D, dtype=dtype, scale=scale),
            fresh_randn(B, H_kv, N_k, D, dtype=dtype), fresh_randn(B, H_kv, N_k, D, dtype=dtype))


def _poisoned(q):
    B, H, N_q, D = q.shape
    return (poison_(torch.empty(B, H, N_q, D, dtype=q.dtype, device=q.device)),
            poison_(torch.empty(B, H, N_q, dtype=torch.float32, device=q.device)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(shape, causal, dtype, impl):
    q, k, v = _inputs(*shape, dtype)
    sm_scale = shape[-1] ** -0.5
    o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl, out=_poisoned(q))
    ref_o, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    baseline = attention_same_precision(q, k, v, causal=causal)
    assert not torch.isnan(o).any(), "an output element was never written (or is NaN)"
    assert_close_2x(o, ref_o, baseline, name=f"O {impl}")
    rounding = lse_rounding(dtype, shape[-1]) if impl == "hopper" else 0.0
    assert_close_2x(lse, ref_lse, ref_lse, name=f"lse {impl}", atol=1e-4 + rounding)


FUZZ_HEAD_DIMS = [40, 72, 80, 96, 112, 160, 192, 256]  # multiples of 8; most not powers of two


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", FUZZ_HEAD_DIMS)
def test_any_head_dim_multiple_of_8(D, causal):
    """Odd lengths, GQA, and a q whose rows are D + 8 wide with NaN past D: a kernel that read
    a padding column from memory (instead of masking it to 0) would turn the output NaN."""
    dtype = DTYPES[0]
    B, H, H_kv, N_q, N_k = 1, 4, 2, 37, 53
    wide = fresh_randn(B, H, N_q, D + 8, dtype=dtype)
    wide[..., D:] = float("nan")
    q = wide[..., :D]
    k = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    v = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    o, lse = _flash_attn_v2_forward(q.contiguous(), k, v, causal, D ** -0.5, out=_poisoned(q))
    o2 = flash_attn_v2(q, k, v, causal=causal)  # the public path, strided q
    ref_o, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(o2).any()
    baseline = attention_same_precision(q, k, v, causal=causal)
    assert_close_2x(o, ref_o, baseline, name=f"O D={D}")
    assert_close_2x(o2, ref_o, baseline, name=f"O D={D} strided q")
    assert_close_2x(lse, ref_lse, ref_lse, name=f"lse D={D}", atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_public_api_and_lse(impl):
    q, k, v = _inputs(1, 2, 2, 33, 45, 64, torch.float16)
    o = flash_attn_v2(q, k, v, causal=True, impl=impl)
    o2, lse = flash_attn_v2(q, k, v, causal=True, return_lse=True, impl=impl)
    assert torch.equal(o, o2) and lse.shape == (1, 2, 33) and lse.dtype == torch.float32


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_that_see_no_key_are_zero_not_nan(impl):
    q, k, v = _inputs(1, 2, 2, 50, 10, 32, torch.float16)
    o, lse = flash_attn_v2(q, k, v, causal=True, return_lse=True, impl=impl)
    blind = 50 - 10  # bottom-right: query i sees keys j <= i - 40
    assert torch.all(o[:, :, :blind] == 0) and torch.all(torch.isinf(lse[:, :, :blind]))
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits(impl):
    for dtype, atol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        q, k, v = _inputs(1, 2, 2, 70, 70, 32, dtype)
        for causal in (False, True):
            o, lse = flash_attn_v2(q, k, v, causal=causal, sm_scale=1e4, return_lse=True,
                                   impl=impl)
            assert torch.isfinite(lse).all()
            ref_lse = attention(q, k, v, causal=causal, sm_scale=1e4, return_lse=True)[1]
            torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-5)
            compared = check_extreme_logits(o, q, k, v, causal, 1e4, atol=atol)
            assert compared >= 0.8 * q.shape[1] * q.shape[2]


def test_strided_inputs_need_no_copy_to_be_right():
    # (B, N, H, D) storage seen as (B, H, N, D): what Hugging Face models hand over
    B, N, H, D = 1, 37, 2, 64
    q, k, v = (fresh_randn(B, N, H, D, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    for impl in IMPLS:
        o = flash_attn_v2(q, k, v, causal=True, impl=impl)
        assert_close_2x(o, attention(q, k, v, causal=True),
                        attention_same_precision(q, k, v, causal=True), name=impl)


def test_output_has_the_layout_of_q_and_inference_stores_no_lse(monkeypatch):
    """A (B, N, H, D) q seen transposed gets an O of that layout (O.transpose(1, 2) is then
    contiguous: the model copies nothing); a call without return_lse stores no lse and gives
    the same O. Every allocation starts as NaN: an element never written would show."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison_(real_empty(*a, **kw)))
    B, N, H, H_kv, D = 2, 37, 4, 2, 32
    q = fresh_randn(B, N, H, D).transpose(1, 2)
    k, v = (fresh_randn(B, N + 6, H_kv, D).transpose(1, 2) for _ in "kv")
    ref = attention(q, k, v, causal=True)
    for impl in IMPLS:
        o = flash_attn_v2(q, k, v, causal=True, impl=impl)
        o_lse, lse = flash_attn_v2(q, k, v, causal=True, impl=impl, return_lse=True)
        assert o.transpose(1, 2).is_contiguous(), impl
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), impl
        assert torch.equal(o, o_lse), impl
        assert_close_2x(o, ref, attention_same_precision(q, k, v, causal=True), name=impl)
    assert flash_attn_v2(q.contiguous(), k, v).is_contiguous()  # a contiguous q: contiguous O


def test_best_impl_takes_the_hopper_kernel_from_enough_work(monkeypatch):
    """On an sm_90 GPU: the Hopper kernel from HOPPER_MIN_PAIRS query-key pairs on, for
    power-of-two head dims from 64 (measured: at B 1, H 32, D 64 the two kernels tie on the GPU
    at N 2048 and the Hopper one costs the host more; at N 4096 it is the faster)."""
    from course_lib.ops import impl as oa

    monkeypatch.setattr(oa, "DEVICE", "cuda")
    monkeypatch.setattr(oa, "IMPLS", ("portable", "hopper"))

    def qkv(N, D, B=1, H=32, H_kv=8):  # expanded views: the shapes, no memory
        return (torch.empty(1, 1, 1, D).expand(B, H, N, D),
                torch.empty(1, 1, 1, D).expand(B, H_kv, N, D),
                torch.empty(1, 1, 1, D).expand(B, H_kv, N, D))

    assert oa.best_impl(*qkv(2048, 64)) == "portable"
    assert oa.best_impl(*qkv(4096, 64)) == "hopper"
    assert oa.best_impl(*qkv(1024, 64, B=32)) == "hopper"  # the sweep's B·N = 32k
    assert oa.best_impl(*qkv(4096, 80)) == "portable"  # not a power of two: padded, portable
    assert oa.best_impl(*qkv(4096, 32)) == "portable"


def test_bad_input_names_the_argument():
    q, k, v = _inputs(1, 2, 2, 16, 16, 64, torch.float16)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_v2(q[0], k, v)
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_v2(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_v2(q, k, v[:, :, :8])
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_v2(q, k.float(), v)
    with pytest.raises(ValueError, match="multiple of"):
        flash_attn_v2(fresh_randn(1, 3, 16, 64, dtype=torch.float16), k, v)
    with pytest.raises(ValueError, match="not supported"):
        d = 44  # not a multiple of 8
        flash_attn_v2(q[..., :d], k[..., :d], v[..., :d])
    with pytest.raises(ValueError, match="sm_scale"):
        flash_attn_v2(q, k, v, sm_scale=-1.0)
    with pytest.raises(ValueError, match="impl"):
        flash_attn_v2(q, k, v, impl="cuda-graphs")
    with pytest.raises(TypeError, match="causal"):
        flash_attn_v2(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="batch x heads"):
        big = fresh_randn(1, 1, 1, 64, dtype=torch.float16).expand(65536, 1, 1, 64)
        flash_attn_v2(big, big, big)
    with pytest.raises(TypeError, match="q has dtype"):
        flash_attn_v2(q.to(torch.int32), k, v)


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    q, k, v = _inputs(1, 1, 1, 16, 16, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        flash_attn_v2(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_long_sequences(D, causal):
    q, k, v = _inputs(2, 8, 2, 1000 + 17, 1000 + 17, D, torch.bfloat16)
    ref = attention(q, k, v, causal=causal)
    for impl in IMPLS:
        o = flash_attn_v2(q, k, v, causal=causal, impl=impl)
        assert_close_2x(o, ref, attention_same_precision(q, k, v, causal=causal), name=impl)


def test_misaligned_contiguous_views_are_copied_for_tma():
    from course_lib.kernels.flash_v2_hopper import tma_compatible, tma_ready

    B, H, N, D = 1, 2, 33, 64
    buf = fresh_randn(B * H * N * D + 1, dtype=torch.float16)
    k = buf[1:].view(B, H, N, D)  # contiguous, but 2 bytes past a 16-byte boundary
    assert k.is_contiguous() and not tma_compatible(k)
    k2 = tma_ready(k)
    assert tma_compatible(k2) and torch.equal(k2, k)
    q, v = (fresh_randn(B, H, N, D, dtype=torch.float16) for _ in range(2))
    for impl in IMPLS:
        o = flash_attn_v2(q, k, v, impl=impl)
        assert_close_2x(o, attention(q, k, v), attention_same_precision(q, k, v), name=impl)
