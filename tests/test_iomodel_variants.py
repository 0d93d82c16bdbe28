"""The variants' block counts (iomodel.variants) against the masks they summarise and against
the dense counts of iomodel.attention."""
import pytest

from course_lib import masks
from course_lib.iomodel.attention import flash_v2_io
from course_lib.iomodel.variants import block_map, variant_io


@pytest.mark.parametrize("n_q,n_k", [(64, 64), (50, 130), (130, 50), (1, 77)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0), (5, 9), (0, 0)])
def test_counts_agree_with_the_mask(n_q, n_k, window):
    bm, bn, d = 16, 8, 32
    io = variant_io(n_q, n_k, d, bm, bn, window, B=2, H=3)
    vis = masks.visible(n_q, n_k, window)
    assert io["visible_pairs"] == 6 * int(vis.sum())
    assert io["visible_flops"] == 4.0 * d * io["visible_pairs"]
    assert io["computed_pairs"] >= io["visible_pairs"]
    kinds = block_map(n_q, n_k, bm, bn, window)
    t_r, t_c = io["tiles"]
    assert len(kinds) == t_r and all(len(r) == t_c for r in kinds)
    assert sum(io["blocks"].values()) == 6 * t_r * t_c
    # every visible pair lies in a tile that runs; every unmasked tile is wholly visible
    for i, row in enumerate(kinds):
        for j, kind in enumerate(row):
            tile = vis[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            assert (kind == "skipped") == (not tile.any())
            if kind == "unmasked":
                assert tile.all()


def test_full_and_causal_match_the_dense_counts():
    d, bm, bn = 64, 128, 64
    for window, causal in (((-1, -1), False), ((-1, 0), True)):
        io = variant_io(1000, 1000, d, bm, bn, window)
        dense = flash_v2_io(1000, 1000, d, bm, bn, causal=causal)
        assert (io["read_bytes"], io["write_bytes"]) == (dense["read_bytes"],
                                                         dense["write_bytes"])


def test_a_window_of_1024_at_16k_visits_an_area_8_25_times_smaller():
    causal = variant_io(16384, 16384, 128, 128, 64, (-1, 0))
    window = variant_io(16384, 16384, 128, 128, 64, (1024, 0))
    assert round(causal["visible_pairs"] / window["visible_pairs"], 2) == 8.25
    # and the tiles it runs: the band's edges cost masked tiles the area does not count
    assert causal["computed_pairs"] / window["computed_pairs"] < 8.25
    assert window["blocks"]["masked"] > causal["blocks"]["masked"]
