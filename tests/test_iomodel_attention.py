"""Attention's HBM traffic: the instrumented loops' counts against the closed forms, the two
scaling laws, the Figure 2 prediction, the figures, the seed sketch and the exercises."""
import math

import pytest
import torch

from course_lib.iomodel import attention as io
from course_lib.reference import attention, flash_v1_reference, flash_v2_reference

SIZES = [  # (N_q, N_k, d, block_m, block_n): partial blocks, N_q != N_k both ways, one block
    (64, 64, 16, 16, 16), (100, 70, 16, 8, 16), (37, 100, 8, 16, 5), (1, 33, 4, 16, 16),
    (33, 1, 4, 4, 8), (50, 50, 8, 64, 64),
]


def v1_closed_form(N_q, N_k, d, block_m, block_n):
    """The paper's Algorithm 1, in elements: K, V once; Q, O, l, m read and O, l, m written at
    each of the T_c passes over the rows; O, l, m initialised once."""
    T_c = math.ceil(N_k / block_n)
    return 2 * N_k * d + T_c * N_q * (2 * d + 2), (1 + T_c) * N_q * (d + 2)


def v2_closed_form(N_q, N_k, d, block_m, block_n):
    """Q once, K and V once per Q block, O and lse written once."""
    T_r = math.ceil(N_q / block_m)
    return N_q * d + 2 * T_r * N_k * d, N_q * (d + 1)


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_counted_equals_closed_form(size):
    N_q, N_k, d, bm, bn = size
    for count, model, closed in ((io.count_flash_v1, io.flash_v1_io, v1_closed_form),
                                 (io.count_flash_v2, io.flash_v2_io, v2_closed_form)):
        hbm, res = count(*size), model(*size)
        print(count.__name__, dict(hbm.reads), dict(hbm.writes))
        assert (hbm.read_elements, hbm.write_elements) == closed(*size)
        assert dict(hbm.reads) == res["reads"] and dict(hbm.writes) == res["writes"]
        assert hbm.hbm_bytes == res["hbm_bytes"]
    std = io.count_standard(N_q, N_k, d)
    assert std.elements == 2 * N_q * d + 2 * N_k * d + 4 * N_q * N_k
    assert std.elements == io.standard_attention_io(N_q, N_k, d)["elements"]


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("skip", [False, True])
def test_counted_equals_model_causal(size, skip):
    """Causal: the model's visited blocks are the ones the loops compute."""
    hbm = io.count_flash_v1(*size, causal=True, skip_masked_blocks=skip)
    res = io.flash_v1_io(*size, causal=True, skip_masked_blocks=skip)
    assert dict(hbm.reads) == res["reads"] and dict(hbm.writes) == res["writes"]
    hbm = io.count_flash_v2(*size, causal=True, skip_masked_blocks=skip)
    res = io.flash_v2_io(*size, causal=True, skip_masked_blocks=skip)
    assert dict(hbm.reads) == res["reads"] and dict(hbm.writes) == res["writes"]
    if skip:  # skipping never costs traffic
        assert res["elements"] <= io.flash_v2_io(*size)["elements"]


def test_counts_scale_with_batch_and_heads_gqa():
    """Every query head's program loads its own K/V blocks: B·H times one head's traffic."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 30, 8, generator=gen)
    k, v = torch.randn(2, 2, 21, 8, generator=gen), torch.randn(2, 2, 21, 8, generator=gen)
    for ref, model in ((flash_v1_reference, io.flash_v1_io), (flash_v2_reference, io.flash_v2_io)):
        hbm = io.HBMCounter()
        ref(q, k, v, 8, 4, causal=True, hbm=hbm)
        res = model(30, 21, 8, 8, 4, B=2, H=4, causal=True,
                    skip_masked_blocks=ref is flash_v2_reference)
        assert dict(hbm.reads) == res["reads"] and hbm.hbm_bytes == res["hbm_bytes"]
    floor = io.compulsory_io(30, 21, 8, B=2, H=4, H_kv=2)
    assert floor["reads"]["K"] == 2 * 2 * 21 * 8 and floor["reads"]["Q"] == 2 * 4 * 30 * 8


def _v1_kernel_bytes(B, H, N_q, N_k, D, causal, bm, bn, elem=2, f32=4):
    """course_lib.kernels.flash_v1's loops, walked by hand: per Q block, its steps j = 0..j_last;
    the first starts from registers, the last writes O in q's dtype, the others hand O_acc, l,
    m (fp32) on through HBM; a Q block that sees no key writes zeros once."""
    read = write = 0
    for i in range(math.ceil(N_q / bm)):
        r = min(bm, N_q - i * bm)
        last_row, j_last = min(i * bm + bm, N_q) - 1, math.ceil(N_k / bn) - 1
        if causal:
            if last_row + N_k - N_q < 0:
                write += r * D * elem
                continue
            j_last = min(j_last, (last_row + N_k - N_q) // bn)
        for j in range(j_last + 1):
            read += r * D * elem + (r * (D + 2) * f32 if j > 0 else 0)
            write += r * (D + 2) * f32 if j < j_last else r * D * elem
    return B * H * (read + 2 * N_k * D * elem), B * H * write


def test_kernel_bookkeeping_matches_the_v1_kernel():
    """``kernel_bookkeeping=True`` counts what course_lib.kernels.flash_v1 moves."""
    for B, H, N_q, N_k, D, causal, bm, bn in [(2, 3, 100, 70, 16, False, 16, 32),
                                              (1, 2, 40, 17, 16, True, 16, 16),
                                              (2, 2, 37, 100, 32, True, 32, 16),
                                              (1, 1, 100, 37, 32, True, 32, 16)]:
        got = io.flash_v1_io(N_q, N_k, D, bm, bn, B, H, 2, causal=causal,
                             skip_masked_blocks=True, kernel_bookkeeping=True)
        assert (got["read_bytes"], got["write_bytes"]) == _v1_kernel_bytes(
            B, H, N_q, N_k, D, causal, bm, bn)


def test_standard_attention_steps():
    steps = io.standard_attention_steps(1024, 64, B=2, H=3, bytes_per_el=2)
    assert [s["name"] for s in steps] == list(io.STANDARD_STEPS)
    N, d, bh = 1024, 64, 6
    assert [s["hbm_bytes"] for s in steps] == [bh * 2 * (2 * N * d + N * N),
                                               bh * 2 * 2 * N * N, bh * 2 * (N * N + 2 * N * d)]
    total = io.standard_attention_io(N, N, d, B=2, H=3)
    assert sum(s["hbm_bytes"] for s in steps) == total["hbm_bytes"]
    assert sum(s["flops"] for s in steps) == total["flops"] == bh * N * N * (4 * d + 5)


def test_flash_attention_io_paper_blocks_and_theorem_2():
    assert io.paper_block_sizes(98304, 64) == (64, 384)
    assert io.paper_block_sizes(1000, 64) == (4, 4)
    with pytest.raises(ValueError):
        io.paper_block_sizes(32, 64)
    res = io.flash_attention_io(1024, 64, 98304, B=64, H=16)
    assert (res["block_m"], res["block_n"], res["M"]) == (64, 384, 98304)
    assert set(res) >= {"flops", "hbm_bytes"}
    # Θ(N²d²/M): traffic·M/(N²d²) stays within constant bounds while M sweeps [16d, Nd/8];
    # standard attention's traffic does not depend on M at all
    N, d = 8192, 64
    ratios = [io.flash_attention_io(N, d, M)["elements"] * M / (N * N * d * d)
              for M in (2 ** k for k in range(10, 17))]
    print("traffic·M/(N²d²):", [f"{r:.2f}" for r in ratios])
    assert max(ratios) / min(ratios) < 1.5 and 10 < min(ratios) < 15
    # and quadrupling N multiplies both by ~16 at large N (both are quadratic in N)
    for f in (lambda n: io.standard_attention_io(n, n, d)["elements"],
              lambda n: io.flash_attention_io(n, d, 98304)["elements"]):
        assert 14 < f(4 * 16384) / f(16384) < 16.5


def test_figure2_prediction():
    B, H, N, d = 64, 16, 1024, 64
    pred = io.figure2_prediction(v1_blocks=(64, 64))
    assert pred["standard"] == B * H * (4 * N * d + 4 * N * N) * 2
    assert pred["flash_v2_min"] == B * H * (4 * N * d * 2 + N * 4)  # Q, K, V, O fp16; lse fp32
    assert pred["flash_v2_min"] < pred["flash_v2"] < pred["standard"]
    assert pred["flash_v1"] < pred["standard"]
    io.print_figure2_prediction(pred)


def test_figures_draw():
    from course_lib import sketch_pitfalls
    from course_lib.widgets import tile_walk

    for name, make in {**io.FIGURES, **tile_walk.FIGURES, **sketch_pitfalls.FIGURES}.items():
        fig = make()
        assert fig.axes, name


def test_tile_walk_records_every_step():
    from course_lib.widgets.tile_walk import draw_step, record_walk

    steps = record_walk(N_q=10, N_k=13, block_m=4, block_n=4, order="v1")
    assert [(s["j"], s["i"]) for s in steps] == [(j, i) for j in range(4) for i in range(3)]
    assert steps[-1]["meta"]["final_hbm"] == steps[-1]["hbm"]
    steps = record_walk(N_q=10, N_k=13, block_m=4, block_n=4, order="v2", causal=True)
    assert [(s["i"], s["j"]) for s in steps] == io.visited_blocks(10, 13, 4, 4, causal=True)
    assert draw_step(steps, 2).axes


def test_sketch_pitfalls_departures():
    from course_lib.sketch_pitfalls import departures

    errs = departures()
    print(errs)
    assert errs.pop("all fixed") < 1e-12
    assert all(e > 1e-2 for e in errs.values()), errs


def test_first_try_is_the_loop_with_every_pitfall():
    from course_lib.sketch_pitfalls import first_try, sketch_forward

    for N_q, N_k, d, B_r, B_c, p in [(11, 8, 16, 4, 3, 0.2), (7, 13, 4, 2, 5, 0.0)]:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
                   for n in (N_q, N_k, N_k))
        ours = first_try(q, k, v, B_r, B_c, p, generator=torch.Generator().manual_seed(5))
        switched = sketch_forward(q, k, v, B_r, B_c, (), causal=True, dropout_p=p,
                                  dropout_seed=5)
        assert (ours - switched).abs().max().item() < 1e-12


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_fused_exercise_counts_equal_v2_without_lse(size):
    """Lesson 04's fused loop (exercise ``fused_attention``) moves what v2 moves, less the lse:
    Q once, K and V once per Q block, O once; and its O is attention's."""
    from course_lib.exercises.attention import fused_attention_solution

    N_q, N_k, d, bm, bn = size
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=gen, dtype=torch.float64) for n in (N_q, N_k, N_k))
    hbm = io.HBMCounter()
    O = fused_attention_solution(q, k, v, hbm, bm, bn)
    res = io.flash_v2_io(*size)
    assert dict(hbm.reads) == res["reads"] and dict(hbm.writes) == {"O": N_q * d}
    assert hbm.read_elements == v2_closed_form(*size)[0]
    ref = attention(q[None, None], k[None, None], v[None, None])[0, 0]
    assert (O - ref).abs().max().item() < 1e-12


def test_exercise_solutions_pass():
    from course_lib.exercises import attention as ex

    assert ex.check_standard_io(ex.standard_io_solution)
    assert ex.check_one_pass_step(ex.one_pass_step_solution)
    assert ex.check_rescale_update(ex.rescale_update_solution)
    assert ex.check_block_sizes(lambda M, d: io.paper_block_sizes(M, d))
    assert ex.check_fused_attention(ex.fused_attention_solution, show=False)

    def stub(*args):
        raise NotImplementedError

    assert not ex.check_rescale_update(stub)
    assert not ex.check_block_sizes(lambda M, d: (d, M // (4 * d)))  # floor, not ceil
