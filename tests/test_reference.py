"""The derivation's references (2-pass, 1-pass, FlashAttention v1 and v2) against ``attention``,
and ``attention`` against PyTorch's scaled_dot_product_attention."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from course_lib.reference import (
    attention,
    attention_1pass,
    attention_2pass,
    flash_v1_reference,
    flash_v2_reference,
)
from course_lib.testing import assert_close_2x, errors

# (B, H, H_kv, N_q, N_k, D, causal, dropout_p): N not a multiple of the blocks, N_q != N_k both
# ways (N_q > N_k with causal leaves rows that see no key), GQA, dropout, a single token.
SHAPES = [
    (2, 4, 2, 17, 33, 16, False, 0.0),
    (1, 2, 1, 40, 17, 8, True, 0.0),
    (2, 2, 2, 37, 37, 16, True, 0.3),
    (1, 3, 3, 33, 20, 8, False, 0.2),
    (1, 4, 1, 25, 61, 8, True, 0.1),
    (1, 1, 1, 1, 1, 4, True, 0.0),
    (1, 2, 2, 1, 97, 8, False, 0.0),
]
BLOCKS = [(4, 8), (16, 5), (64, 64)]


def _qkv(B, H, H_kv, N_q, N_k, D, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N_q, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_kv, N_k, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_kv, N_k, D, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _implementations():
    yield "2pass", attention_2pass
    yield "1pass", attention_1pass
    for name, fn in (("v1", flash_v1_reference), ("v2", flash_v2_reference)):
        for bm, bn in BLOCKS:
            yield f"{name}[{bm}x{bn}]", partial(fn, block_m=bm, block_n=bn)
    yield "v1[skip masked]", partial(flash_v1_reference, block_m=8, block_n=8,
                                     skip_masked_blocks=True)
    yield "v2[no skip]", partial(flash_v2_reference, block_m=8, block_n=8,
                                 skip_masked_blocks=False)


IMPLS = dict(_implementations())


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}D{}{}p{}".format(
    *s[:6], "c" if s[6] else "", s[7]))
def test_reference_equals_attention(impl, shape):
    B, H, H_kv, N_q, N_k, D, causal, p = shape
    kw = {"causal": causal, "dropout_p": p, "dropout_seed": 1234, "return_lse": True}
    q, k, v = _qkv(B, H, H_kv, N_q, N_k, D, seed=N_q * 1000 + N_k)
    o64, lse64 = attention(q.double(), k.double(), v.double(), **kw)
    o32, lse32 = attention(q, k, v, **kw)

    # fp64 in: the same result to fp64 round-off
    o, lse = IMPLS[impl](q.double(), k.double(), v.double(), **kw)
    assert errors(o, o64)[0] < 1e-12 and errors(lse, lse64)[0] < 1e-12

    # fp32 in: within 2x torch's own fp32 error, plus round-off that grows with the key count
    o, lse = IMPLS[impl](q, k, v, **kw)
    assert o.dtype == torch.float32 and o.shape == o32.shape and lse.shape == lse32.shape
    assert_close_2x(o, o64, o32, name=f"{impl} O", atol=N_k * 1e-7)
    assert_close_2x(lse, lse64, lse32, name=f"{impl} lse", atol=N_k * 1e-7)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_rows_that_see_no_key(impl):
    """Bottom-right causal with N_q > N_k: the first N_q - N_k rows give O = 0 and lse = -inf."""
    q, k, v = _qkv(1, 2, 1, 23, 9, 8, seed=7)
    o, lse = IMPLS[impl](q, k, v, causal=True, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[:, :, :14] == 0).all()
    assert torch.isneginf(lse[:, :, :14]).all() and torch.isfinite(lse[:, :, 14:]).all()


def test_dropout_uses_the_shared_mask():
    """Same seed: same output; another seed: another output; p=0: no dropout at all."""
    q, k, v = _qkv(1, 2, 2, 19, 23, 8, seed=3)
    kw = {"dropout_p": 0.25}
    a = flash_v1_reference(q, k, v, 8, 8, dropout_seed=11, **kw)
    assert torch.allclose(a, attention(q, k, v, dropout_seed=11, **kw), atol=1e-6)
    assert not torch.allclose(a, attention(q, k, v, dropout_seed=12, **kw), atol=1e-3)
    assert torch.allclose(flash_v2_reference(q, k, v, 8, 8), attention(q, k, v), atol=1e-6)


def test_sm_scale_and_input_checks():
    q, k, v = _qkv(1, 2, 2, 9, 9, 8, seed=5)
    for fn in (attention_1pass, lambda *a, **kw: flash_v1_reference(*a, 4, 4, **kw)):
        assert torch.allclose(fn(q, k, v, sm_scale=0.3), attention(q, k, v, sm_scale=0.3),
                              atol=1e-6)
    with pytest.raises(ValueError, match="heads"):
        flash_v2_reference(q, k[:, :1].expand(1, 3, 9, 8), v[:, :1].expand(1, 3, 9, 8), 4, 4)
    with pytest.raises(ValueError, match="dropout_seed"):
        flash_v1_reference(q, k, v, 4, 4, dropout_p=0.1)


# ---------------------------------------------------------------------------------------------
# attention itself against PyTorch, where both apply
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N_q,N_k,causal,H_kv", [
    (33, 33, False, 4), (33, 33, True, 4), (17, 50, False, 2), (1, 97, False, 1),
    (64, 64, True, 1),
])
def test_attention_equals_sdpa(N_q, N_k, causal, H_kv):
    q, k, v = _qkv(2, 4, H_kv, N_q, N_k, 16, seed=N_q + N_k)
    # SDPA's is_causal is top-left aligned; with N_q == N_k it equals our bottom-right one
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                          enable_gqa=H_kv != 4)
    assert errors(attention(q.double(), k.double(), v.double(), causal=causal), want)[0] < 1e-12


def test_attention_equals_sdpa_bottom_right_causal():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _qkv(1, 2, 2, 20, 45, 8, seed=9)
    bias = causal_lower_right(20, 45)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias)
    assert errors(attention(q.double(), k.double(), v.double(), causal=True), want)[0] < 1e-12
    # and the log-sum-exp is the row's log Σ exp(sm_scale·q·k)
    _, lse = attention(q.double(), k.double(), v.double(), return_lse=True)
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(8)
    assert errors(lse, torch.logsumexp(s, -1))[0] < 1e-12
