"""The variants' mask rules (course_lib.masks) and their references (reference.attention_variants,
attention_varlen): checked against brute force and against the dense reference they generalise."""
import math

import pytest
import torch

from course_lib import masks
from course_lib import reference as ref

WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (0, 4), (-1, 3), (7, -1), (40, 40)]


def _brute_visible(n_q, n_k, left, right):
    out = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        p = i + n_k - n_q
        for j in range(n_k):
            out[i, j] = (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    return out


def test_normalize_window_maps_causal_to_right_zero_and_names_the_argument():
    assert masks.normalize_window((-1, -1)) == (-1, -1)
    assert masks.normalize_window((-1, -1), causal=True) == (-1, 0)
    assert masks.normalize_window([16, 3], causal=True) == (16, 0)
    for bad in ((1,), (1, 2, 3), "ab", (1.0, 2), (True, 0), None):
        with pytest.raises(TypeError, match="window_size"):
            masks.normalize_window(bad)
    for bad in ((-2, 0), (0, -5)):
        with pytest.raises(ValueError, match="window_size"):
            masks.normalize_window(bad)


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (5, 5), (7, 13), (13, 7), (1, 9), (16, 16)])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_is_the_band_of_each_query_position(n_q, n_k, window):
    assert torch.equal(masks.visible(n_q, n_k, window), _brute_visible(n_q, n_k, *window))


def test_visible_causal_is_the_bottom_right_causal_mask():
    for n_q, n_k in ((5, 5), (3, 8), (8, 3)):
        assert torch.equal(masks.visible(n_q, n_k, masks.normalize_window((-1, -1), True)),
                           ref.causal_mask(n_q, n_k))


@pytest.mark.parametrize("n_q,n_k", [(17, 17), (9, 30), (30, 9), (64, 64)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("bm,bn", [(4, 4), (8, 4), (4, 8), (16, 16)])
def test_block_kind_agrees_with_the_mask_it_summarises(n_q, n_k, window, bm, bn):
    vis = _brute_visible(n_q, n_k, *window)
    for r0 in range(0, n_q, bm):
        r1 = min(r0 + bm, n_q)
        lo, full_lo, full_hi, hi = masks.block_key_range(r0, r1, n_q, n_k, window)
        cols = vis[r0:r1].any(0).nonzero().flatten()
        if len(cols):
            assert (lo, hi) == (cols.min().item(), cols.max().item() + 1)
        else:
            assert lo >= hi
        full = vis[r0:r1].all(0)
        for c0 in range(0, n_k, bn):
            c1 = c0 + bn  # the last block may run past n_k: its tail is masked
            block = vis[r0:r1, c0:min(c1, n_k)]
            kind = masks.block_kind(r0, r1, c0, c1, n_q, n_k, window)
            if not block.any():
                assert kind == "skipped"
            elif block.all() and c1 <= n_k:
                assert kind == "unmasked"
                assert full[c0:c1].all() and full_lo <= c0 and c1 <= full_hi
            else:
                assert kind == "masked"


def test_alibi_bias_is_minus_slope_times_distance_from_the_query_position():
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    bias = masks.alibi_bias(slopes, 3, 5)  # (1, 2, 3, 5)
    for h in range(2):
        for i in range(3):
            for j in range(5):
                assert bias[0, h, i, j].item() == -slopes[h].item() * abs(i + 2 - j)
    per_batch = masks.alibi_bias(torch.rand(4, 2, dtype=torch.float64), 3, 5)
    assert per_batch.shape == (4, 2, 3, 5)


def _qkv(B=2, H=4, H_kv=2, n_q=7, n_k=11, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n_q, D, generator=g, dtype=torch.float64),
            torch.randn(B, H_kv, n_k, D, generator=g, dtype=torch.float64),
            torch.randn(B, H_kv, n_k, D, generator=g, dtype=torch.float64))


def _brute(q, k, v, scale, window, softcap, slopes, sinks):
    """Row by row, key by key, in Python floats: the variants' definition written out."""
    B, H, n_q, D = q.shape
    n_k, group = k.shape[2], H // k.shape[1]
    o = torch.zeros_like(q)
    lse = torch.zeros(B, H, n_q, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(n_q):
                p, logits = i + n_k - n_q, []
                for j in range(n_k):
                    left, right = window
                    if (left >= 0 and j < p - left) or (right >= 0 and j > p + right):
                        continue
                    s = scale * float(q[b, h, i] @ k[b, h // group, j])
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[h]) * abs(p - j)
                    logits.append((s, j))
                all_logits = [s for s, _ in logits]
                if sinks is not None:
                    all_logits.append(float(sinks[h]))
                if not all_logits:
                    lse[b, h, i] = float("-inf")
                    continue
                m = max(all_logits)
                z = sum(math.exp(s - m) for s in all_logits)
                lse[b, h, i] = m + math.log(z)
                for s, j in logits:
                    o[b, h, i] += math.exp(s - lse[b, h, i].item()) * v[b, h // group, j]
    return o, lse


@pytest.mark.parametrize("n_q,n_k", [(7, 11), (11, 7), (1, 9)])
@pytest.mark.parametrize("causal,window,softcap,alibi,sinks", [
    (False, (-1, -1), 0.0, False, False),
    (True, (-1, -1), 0.0, False, False),
    (False, (3, 2), 0.0, False, False),
    (True, (4, -1), 0.0, False, False),
    (False, (-1, -1), 2.0, False, False),
    (False, (-1, -1), 0.0, True, False),
    (False, (-1, -1), 0.0, False, True),
    (True, (2, -1), 1.5, True, True),
])
def test_attention_variants_follow_their_definition(n_q, n_k, causal, window, softcap, alibi,
                                                    sinks):
    q, k, v = _qkv(n_q=n_q, n_k=n_k)
    g = torch.Generator().manual_seed(1)
    slopes = torch.rand(4, generator=g, dtype=torch.float64) if alibi else None
    sink = torch.randn(4, generator=g, dtype=torch.float64) if sinks else None
    o, lse = ref.attention_variants(q, k, v, causal, 0.3, window_size=window, softcap=softcap,
                                    alibi_slopes=slopes, sinks=sink, return_lse=True)
    want_o, want_lse = _brute(q, k, v, 0.3, masks.normalize_window(window, causal), softcap,
                              slopes, sink)
    torch.testing.assert_close(o, want_o, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)


def test_without_variants_it_is_the_dense_reference():
    q, k, v = _qkv()
    for causal in (False, True):
        o, lse = ref.attention_variants(q, k, v, causal, return_lse=True)
        want_o, want_lse = ref.attention(q, k, v, causal, return_lse=True)
        torch.testing.assert_close(o, want_o, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


def test_rows_that_see_no_key_give_zero_and_the_sink():
    q, k, v = _qkv(n_q=9, n_k=4)  # causal: the first 5 rows see nothing
    o, lse = ref.attention_variants(q, k, v, causal=True, return_lse=True)
    assert (o[:, :, :5] == 0).all() and torch.isinf(lse[:, :, :5]).all()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    o, lse = ref.attention_variants(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert (o[:, :, :5] == 0).all()
    torch.testing.assert_close(lse[:, :, :5], sinks[None, :, None].expand(2, 4, 5))
    # a sink only rescales a row: o = o_plain · σ(lse_plain − sink), lse = logaddexp
    o_plain, lse_plain = ref.attention_variants(q, k, v, causal=True, return_lse=True)
    rows = slice(5, None)
    torch.testing.assert_close(
        o[:, :, rows], o_plain[:, :, rows]
        * torch.sigmoid(lse_plain[:, :, rows] - sinks[None, :, None])[..., None])
    torch.testing.assert_close(lse[:, :, rows],
                               torch.logaddexp(lse_plain[:, :, rows], sinks[None, :, None]))


def test_the_sinks_gradient_is_minus_the_sink_share_times_do_dot_o():
    """dL/dsink_h = −Σ_i p_sink,i (dO_i · O_i): the formula a fused backward will use."""
    q, k, v = _qkv(n_q=6, n_k=10)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    o, lse = ref.attention_variants(q, k, v, True, window_size=(3, -1), sinks=sinks,
                                    return_lse=True)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    p_sink = torch.exp(sinks.detach()[None, :, None] - lse.detach())  # (B, H, N_q)
    want = -(p_sink * (do * o.detach()).sum(-1)).sum(dim=(0, 2))
    torch.testing.assert_close(sinks.grad, want)


def test_the_softcap_gradient_is_the_chain_rule_through_tanh():
    """dS_raw = dS · (1 − tanh²(S_raw / c)), S_raw = sm_scale·QKᵀ: checked on q's gradient."""
    q, k, v = _qkv(B=1, H=2, H_kv=2, n_q=5, n_k=6, D=8)
    q.requires_grad_(True)
    c, scale = 1.5, 0.4
    o = ref.attention_variants(q, k, v, sm_scale=scale, softcap=c)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    with torch.no_grad():  # by hand: P from the capped scores, dP, dS, then through tanh
        raw = scale * q @ k.transpose(-1, -2)
        p = torch.softmax(c * torch.tanh(raw / c), dim=-1)
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        d_raw = ds * (1 - torch.tanh(raw / c) ** 2)
        want = scale * d_raw @ k
    torch.testing.assert_close(q.grad, want)


def test_varlen_is_each_sequence_on_its_own():
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 5, 6]
    cu_q = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11, 17], dtype=torch.int32)
    H, H_kv, D = 4, 2, 8
    q = torch.randn(9, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(17, H_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(17, H_kv, D, generator=g, dtype=torch.float64)
    slopes = torch.rand(4, H, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    o, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, window_size=(2, -1),
                                  alibi_slopes=slopes, sinks=sinks, return_lse=True)
    assert o.shape == (9, H, D) and lse.shape == (H, 9)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lb = ref.attention_variants(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                        v[ks].transpose(0, 1)[None], True, window_size=(2, -1),
                                        alibi_slopes=slopes[b], sinks=sinks, return_lse=True)
        torch.testing.assert_close(o[qs], ob[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, qs], lb[0])
    assert lens_q[1] == 0 and lens_k[1] == 2  # an empty query sequence is allowed
    with pytest.raises(ValueError, match="max_seqlen_k"):
        ref.attention_varlen(q, k, v, cu_q, cu_k, 5, 5)


def test_check_variants_names_the_argument():
    from course_lib.masks import check_variants

    q = torch.randn(2, 4, 3, 8)
    assert check_variants(q, True, (-1, -1), 0, None, None)[:2] == ((-1, 0), 0.0)
    capped = check_variants(q, False, (8, 8), 30.0, torch.rand(4), torch.rand(4))
    assert capped[:2] == ((8, 8), 30.0)
    slopes = torch.rand(2, 4)
    variant = check_variants(q, False, (8, 8), 1, slopes, None)
    assert variant[:2] == ((8, 8), 1.0) and variant.alibi_slopes is slopes and not variant.dense
    cases = [
        (TypeError, "causal", dict(causal=1)),
        (ValueError, "window_size", dict(window_size=(-3, 0))),
        (TypeError, "window_size", dict(window_size=4)),
        (ValueError, "softcap", dict(softcap=-1.0)),
        (ValueError, "softcap", dict(softcap=float("nan"))),
        (TypeError, "softcap", dict(softcap="30")),
        (TypeError, "alibi_slopes", dict(alibi_slopes=[0.5] * 4)),
        (TypeError, "alibi_slopes", dict(alibi_slopes=torch.rand(4, dtype=torch.float64))),
        (ValueError, "alibi_slopes", dict(alibi_slopes=torch.rand(3))),
        (ValueError, "alibi_slopes", dict(alibi_slopes=torch.rand(4, 4))),
        (ValueError, "sinks", dict(sinks=torch.rand(2, 4))),
        (TypeError, "sinks", dict(sinks=torch.rand(4).half())),
    ]
    for err, name, bad in cases:
        args = dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    sinks=None) | bad
        with pytest.raises(err, match=name):
            check_variants(q, args["causal"], args["window_size"], args["softcap"],
                           args["alibi_slopes"], args["sinks"])


def test_check_varlen_names_the_argument():
    from course_lib.validate import check_varlen

    q, k = torch.randn(9, 4, 8), torch.randn(17, 2, 8)
    cu_q = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 17], dtype=torch.int32)
    assert check_varlen(q, k, cu_q, cu_k, 6, 7, read_values=True) == 3
    cases = [
        (TypeError, "cu_seqlens_q", (cu_q.long(), cu_k, 6, 7)),
        (ValueError, "cu_seqlens_k", (cu_q, cu_k[:3], 6, 7)),
        (TypeError, "max_seqlen_q", (cu_q, cu_k, 6.0, 7)),
        (TypeError, "max_seqlen_k", (cu_q, cu_k, 6, -1)),
        (ValueError, "cu_seqlens_q must start at 0", (cu_q + 1, cu_k, 6, 7)),
        (ValueError, "cu_seqlens_k must not decrease",
         (cu_q, torch.tensor([0, 12, 10, 17], dtype=torch.int32), 6, 7)),
        (ValueError, "cu_seqlens_q ends at 8",
         (torch.tensor([0, 3, 3, 8], dtype=torch.int32), cu_k, 6, 7)),
        (ValueError, "max_seqlen_k = 6", (cu_q, cu_k, 6, 6)),
    ]
    for err, msg, args in cases:
        with pytest.raises(err, match=msg):
            check_varlen(q, k, *args, read_values=True)
    # without read_values nothing is read back: a bad offset passes the shape checks
    assert check_varlen(q, k, cu_q + 1, cu_k, 6, 7) == 3
