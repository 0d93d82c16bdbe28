"""Backward-pass HBM traffic: counted loops agree with the closed forms; Theorem 5's scaling."""
import math

import pytest
import torch

from course_lib.iomodel.backward import (
    count_flash_backward,
    count_standard_backward,
    flash_backward_io,
    flash_backward_reference,
    flash_v2_backward_io,
    forward_statistics,
    plot_backward_io_vs_N,
    recompute_tradeoff,
    standard_backward_io,
    theorem5_io,
)
from course_lib.reference import attention


def _autograd(q, k, v, do, causal, scale=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = attention(*leaves, causal=causal, sm_scale=scale)
    return torch.autograd.grad(o, leaves, do)


@pytest.mark.parametrize("n_q,n_k,d", [(16, 16, 8), (17, 33, 4), (40, 9, 16)])
def test_standard_backward_counted_equals_closed_form_and_is_right(n_q, n_k, d):
    hbm, (q, k, v, do), grads = count_standard_backward(n_q, n_k, d)
    io = standard_backward_io(n_q, n_k, d)
    assert dict(hbm.reads) == io["reads"] and dict(hbm.writes) == io["writes"]
    assert hbm.hbm_bytes == io["hbm_bytes"]
    assert io["elements"] == 7 * n_q * n_k + 4 * n_q * d + 4 * n_k * d
    for g, r in zip(grads, _autograd(q[None, None], k[None, None], v[None, None],
                                     do[None, None], False)):
        torch.testing.assert_close(g, r[0, 0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,bm,bn", [(32, 32, 8, 16), (37, 50, 8, 16), (50, 23, 16, 8),
                                           (1, 9, 4, 4)])
def test_algorithm4_gradients_match_autograd(n_q, n_k, bm, bn, causal):
    gen = torch.Generator().manual_seed(n_q + n_k)
    q, do = (torch.randn(2, 2, n_q, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, n_k, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    o, l, m = forward_statistics(q, k, v, causal)
    for skip in (False, True):
        got = flash_backward_reference(q, k, v, o, do, l, m, bm, bn, causal=causal,
                                       skip_masked_blocks=skip)
        for g, r in zip(got, _autograd(q, k, v, do, causal)):
            torch.testing.assert_close(g, r)


@pytest.mark.parametrize("causal,skip", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("n_q,n_k,d,bm,bn", [(64, 64, 16, 16, 32), (70, 45, 8, 16, 8),
                                             (33, 100, 4, 8, 16)])
def test_algorithm4_counted_equals_closed_form(n_q, n_k, d, bm, bn, causal, skip):
    hbm = count_flash_backward(n_q, n_k, d, bm, bn, causal=causal, skip_masked_blocks=skip)
    io = flash_backward_io(n_q, n_k, d, bm, bn, causal=causal, skip_masked_blocks=skip)
    assert dict(hbm.reads) == io["reads"] and dict(hbm.writes) == io["writes"]
    assert hbm.hbm_bytes == io["hbm_bytes"]
    if not skip:  # every pair: 4·N·d + N·d + T_c·N·(5d + 2) for N_q = N_k
        T_c = math.ceil(n_k / bn)
        assert io["elements"] == 2 * n_k * d + n_q * d + 2 * n_k * d + T_c * n_q * (5 * d + 2)


def test_theorem5_scaling():
    """Θ(N²d²/M): elements / (N²d²/M) tends to (5d + 2)·M / (d²·B_c) ≈ 20(1 + 2/(5d)) with
    B_c = ⌈M/4d⌉; the standard backward is Θ(Nd + N²)."""
    d, M = 64, 100_000
    ratios = [theorem5_io(n, d, M)["elements"] / theorem5_io(n, d, M)["n2d2_over_M"]
              for n in (4096, 16384, 65536, 2**20)]
    limit = (5 * d + 2) * M / (d * d * math.ceil(M / (4 * d)))
    assert abs(limit - 20 * (1 + 2 / (5 * d))) < 0.05
    assert all(r > limit for r in ratios)  # the O(Nd) terms and ⌈N/B_c⌉ only add
    assert all(a > b for a, b in zip(ratios, ratios[1:]))  # ... and fade as N grows
    assert abs(ratios[-1] - limit) / limit < 0.001 and abs(ratios[1] - limit) / limit < 0.05
    # a larger SRAM means fewer passes over the rows, down to one pass when B_c >= N
    small, big = theorem5_io(4096, d, 20_000), theorem5_io(4096, d, 2_000_000)
    assert small["elements"] > 5 * big["elements"]
    std = theorem5_io(4096, d, M)["standard"]
    assert std["elements"] == 7 * 4096**2 + 8 * 4096 * d


def test_flash_v2_backward_io():
    io = flash_v2_backward_io(1024, 1024, 64, 32, 128, 128, 32, B=2, H=4, H_kv=2)
    kern = io["kernels"]
    # non-causal: each of the 8 K/V blocks sees all 1024 rows of each query head
    assert kern["dkdv"]["reads"]["Q"] == 2 * 4 * 8 * 1024 * 64
    assert kern["dkdv"]["reads"]["K"] == 2 * 2 * 1024 * 64  # once per K/V head
    assert kern["dq"]["reads"]["K"] == 2 * 4 * 8 * 1024 * 64  # 8 Q blocks, each all keys
    assert io["compulsory"]["elements"] < io["elements"]
    causal = flash_v2_backward_io(1024, 1024, 64, 32, 128, 128, 32, causal=True)
    full = flash_v2_backward_io(1024, 1024, 64, 32, 128, 128, 32)
    assert 0.5 < causal["kernels"]["dq"]["reads"]["K"] / full["kernels"]["dq"]["reads"]["K"] < 0.6
    # rows that see no key: N_q > N_k causal, the first N_q - N_k rows are never streamed
    tall = flash_v2_backward_io(300, 100, 16, 16, 64, 64, 16, causal=True)
    assert tall["kernels"]["dkdv"]["reads"]["Q"] <= (300 - 200) * 2 * 16


def test_recompute_tradeoff():
    t = recompute_tradeoff(8192, 64, B=1, H=16, peak_tflops=989.0, hbm_tbs=3.35)
    assert t["flops_recompute"] == 2.5 * t["flops_forward"]
    assert t["extra_fraction"] == pytest.approx(0.25)
    assert t["bytes_saved"] == 16 * 8192**2 * 2 - 16 * 8192 * 4
    assert t["extra_compute_s"] < t["saved_traffic_s"]  # d = 64 is far below break-even
    assert 500 < t["break_even_d"] < 700
    c = recompute_tradeoff(8192, 64, causal=True)
    assert c["extra_flops"] == pytest.approx(recompute_tradeoff(8192, 64)["extra_flops"] / 2)


def test_figure_draws():
    fig = plot_backward_io_vs_N(seq_lens=(256, 1024))
    assert len(fig.axes[0].lines) == 3
