"""The matmul IO model: the simulator equals the closed form, and the seed's 65536 → 4096."""
import numpy as np
import pytest

from course_lib import iomodel
from course_lib.iomodel.matmul import (
    CountingMatrix,
    Traffic,
    largest_square_tile,
    matmul_compulsory_bytes,
    matmul_global_reads,
    matmul_hbm_bytes,
    matmul_traffic,
    simulate_naive,
    simulate_tiled,
    tile_smem_bytes,
)


def _ab(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)), rng.standard_normal((k, n))


def test_the_seed_example():
    a, b = _ab(32, 32, 32)
    c, naive = simulate_naive(a, b)
    assert np.allclose(c, a @ b)
    assert naive.global_reads == 2 * 32 * 32 * 32 == 65536
    c, tiled = simulate_tiled(a, b, 16)
    assert np.allclose(c, a @ b)
    assert tiled.global_reads == 4096
    assert matmul_global_reads(32, 32, 32) == 65536
    assert matmul_global_reads(32, 32, 32, tile=16) == 4096
    assert iomodel.matmul_global_reads(32, 32, 32, tile=16) == 4096  # the package re-exports


SIZES = [(1, 1, 1), (1, 7, 3), (5, 1, 9), (8, 8, 8), (16, 16, 16), (17, 5, 9), (20, 28, 24),
         (32, 32, 32), (33, 31, 17), (7, 40, 13), (24, 24, 48)]
TILES = [1, 2, 3, 4, 8, 16, 32, (4, 8, 2), (8, 3, 5), (16, 8, 32)]


@pytest.mark.parametrize("m, n, k", SIZES)
def test_formula_equals_simulation_tiled(m, n, k):
    a, b = _ab(m, n, k, seed=m * 100 + n * 10 + k)
    for tile in TILES:
        c, counted = simulate_tiled(a, b, tile)
        assert np.allclose(c, a @ b), (m, n, k, tile)
        formula = matmul_traffic(m, n, k, tile)
        assert counted == formula, (m, n, k, tile, counted, formula)
        assert counted.reads_by_tensor["A"] == formula.reads_by_tensor["A"]


@pytest.mark.parametrize("m, n, k", SIZES)
def test_formula_equals_simulation_naive(m, n, k):
    a, b = _ab(m, n, k, seed=1)
    c, counted = simulate_naive(a, b)
    assert np.allclose(c, a @ b)
    assert counted == matmul_traffic(m, n, k)
    assert counted.global_reads == 2 * m * n * k and counted.global_writes == m * n


def test_formula_equals_simulation_random_sizes():
    rng = np.random.default_rng(2024)
    for _ in range(40):
        m, n, k = (int(x) for x in rng.integers(1, 30, size=3))
        tile = int(rng.integers(1, 20))
        a, b = _ab(m, n, k, seed=int(rng.integers(1 << 30)))
        _, counted = simulate_tiled(a, b, tile)
        assert counted == matmul_traffic(m, n, k, tile), (m, n, k, tile)


def test_closed_form_properties():
    # square tiles dividing the sizes: exactly 2mnk/T; tile 1 is the naive count; shared reads
    # do not depend on the tile: tiling moves re-reads on chip, it does not remove them
    for n, T in ((64, 8), (128, 32), (4096, 128)):
        assert matmul_global_reads(n, n, n, T) == 2 * n**3 // T
    assert matmul_global_reads(20, 28, 24, 1) == matmul_global_reads(20, 28, 24)
    assert {matmul_traffic(48, 40, 32, T).shared_reads for T in (2, 8, 16)} == {2 * 48 * 40 * 32}
    # a tile as large as the matrices reaches the floor: every input read once
    assert matmul_global_reads(48, 40, 32, 64) == 48 * 32 + 32 * 40
    assert matmul_hbm_bytes(48, 40, 32, 64, 2) == matmul_compulsory_bytes(48, 40, 32, 2)
    # ragged example of the exercise
    assert matmul_global_reads(48, 40, 32, 16) == 48 * 32 * 3 + 32 * 40 * 3


def test_tile_footprint():
    assert tile_smem_bytes(16, 4) == 2 * 16 * 16 * 4
    assert tile_smem_bytes((128, 256, 64), 2, stages=3) == 3 * (128 * 64 + 64 * 256) * 2
    assert largest_square_tile(228 * 1024, 2) == 241      # H100: 2·241²·2 B ≤ 228 KiB < 2·242²·2
    assert largest_square_tile(100 * 1024, 4) == 113


def test_bad_arguments():
    with pytest.raises(ValueError, match="m must be positive"):
        matmul_global_reads(0, 1, 1)
    with pytest.raises(TypeError, match="tile must be an int"):
        matmul_global_reads(4, 4, 4, tile="big")
    with pytest.raises(ValueError, match="tile sizes must be positive"):
        matmul_global_reads(4, 4, 4, tile=0)
    with pytest.raises(ValueError, match="inner dimensions"):
        simulate_naive(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="space"):
        CountingMatrix(np.ones(2), Traffic(), "L2")


def test_counting_matrix_counts_clipped_blocks():
    t = Traffic()
    x = CountingMatrix(np.ones((5, 5)), t, "global", "X")
    x[3:8, 0:2]                      # hangs over the edge: 2 rows × 2 columns are inside
    assert t.global_reads == 4 and t.reads_by_tensor == {"X": 4}
    s = CountingMatrix(np.zeros((2, 2)), t, "shared")
    s[:, :] = 1.0
    assert t.shared_writes == 4 and t.global_writes == 0


def test_tile_sweep_plot(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.iomodel.matmul import FIGURES

    fig = FIGURES["tile_sweep"]()
    fig.savefig(tmp_path / "sweep.png")
    plt.close(fig)


def test_widget_moves_and_counts(tmp_path):
    from course_lib.widgets.tiled_matmul import (
        FIGURES,
        TiledMatmulWidget,
        describe_step,
        schedule,
    )

    steps = schedule(32, 32, 32, 16)
    assert len(steps) == 8 and steps[-1].reads_so_far == 4096
    steps = schedule(20, 28, 24, 8)
    assert steps[-1].reads_so_far == matmul_global_reads(20, 28, 24, 8)
    w = TiledMatmulWidget()
    first = w.image.value
    assert first[:4] == b"\x89PNG" and "512" in w.counter.value
    w.step_slider.value = 7
    assert "4096" in w.counter.value and w.image.value != first
    w.tile_slider.value = 8
    assert w.step_slider.max == 63
    w.step_slider.value = 63
    assert "so far 8192" in w.counter.value
    assert "65536" in describe_step(32, 32, 32, 4, 0)
    fig = FIGURES["tiled_matmul"]()
    fig.savefig(tmp_path / "tm.png")
