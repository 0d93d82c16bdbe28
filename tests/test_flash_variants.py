"""The variants' forward kernel (kernels.flash_variants) against reference.attention_variants:
the 2x rule, odd lengths, N_q != N_k, GQA, padded head dims, poisoned outputs."""
import itertools

import pytest
import torch

from course_lib import masks
from course_lib.kernels.flash_variants import forward_variants
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
}


def _extras(name, B, H, device):
    causal, window, softcap, alibi, sinks = VARIANTS[name]
    g = torch.Generator().manual_seed(len(name))
    slopes = None
    if alibi:
        slopes = (torch.rand((B, H) if alibi == "batch" else (H,), generator=g) * 0.5).to(device)
    sink = (torch.randn(H, generator=g) * 2).to(device) if sinks else None
    return causal, window, softcap, slopes, sink


def _run(q, k, v, name, sm_scale=None):
    B, H, N_q, D = q.shape
    causal, window, softcap, slopes, sink = _extras(name, B, H, q.device)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    out = (poison_(torch.empty_like(q)), poison_(torch.empty(B, H, N_q, device=q.device)))
    o, lse = forward_variants(q, k, v, sm_scale, masks.normalize_window(window, causal),
                              softcap, slopes, sink, out=out)
    kw = dict(causal=causal, sm_scale=sm_scale, window_size=window, softcap=softcap,
              alibi_slopes=slopes, sinks=sink)
    ref_o, ref_lse = attention_variants(q, k, v, return_lse=True, **kw)
    return o, lse, ref_o, ref_lse, variants_same_precision(q, k, v, **kw)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_the_reference(shape, name, dtype):
    B, H, H_kv, N_q, N_k, D = shape
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    v = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    o, lse, ref_o, ref_lse, same = _run(q, k, v, name)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "an element never written"
    assert_close_2x(o, ref_o, same, name=f"O {name}")
    seen = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen), "rows that see no key: lse -inf, and only them"
    assert_close_2x(lse[seen], ref_lse[seen], ref_lse[seen], name=f"lse {name}", atol=1e-4)


def test_every_combination_of_the_variants():
    """window x causal x softcap x ALiBi x sinks x GQA, one odd shape each, fp32."""
    B, H, H_kv, N_q, N_k, D = 1, 4, 2, 29, 41, 32
    q, k, v = (fresh_randn(B, h, n, D) for h, n in ((H, N_q), (H_kv, N_k), (H_kv, N_k)))
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(H, generator=g).to(q.device)
    sinks = torch.randn(H, generator=g).to(q.device)
    for causal, window, softcap, alibi, sink in itertools.product(
            (False, True), ((-1, -1), (6, 2), (0, 0)), (0.0, 2.5), (None, slopes),
            (None, sinks)):
        w = masks.normalize_window(window, causal)
        o, lse = forward_variants(q, k, v, 0.2, w, softcap, alibi, sink)
        ref_o, ref_lse = attention_variants(q, k, v, causal, 0.2, window_size=window,
                                            softcap=softcap, alibi_slopes=alibi, sinks=sink,
                                            return_lse=True)
        torch.testing.assert_close(o, ref_o, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_a_window_skips_the_blocks_outside_the_band():
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
    o, _ = forward_variants(q, k2, v2, D ** -0.5, window, 0.0)
    torch.testing.assert_close(o[:, :, 384:], o_ref[:, :, 384:], atol=1e-5, rtol=1e-5)
