"""Lesson 15's pictures and counts: the block-map widget (course_lib.widgets.block_map), its static
figures, the score-change figure (course_lib.diagrams.variants) and the fast count behind the
lesson's think-question, each against the masks and iomodel.variants they draw."""
import numpy as np
import pytest
import torch

from course_lib import masks
from course_lib.iomodel.variants import variant_io
from course_lib.widgets import block_map as bmw


@pytest.mark.parametrize("variant,left,right,want", [
    ("full", 5, 7, (-1, -1)), ("causal", 5, 7, (-1, 0)), ("sliding window", 5, 7, (5, 7)),
    ("sliding window", -1, 3, (-1, 3)), ("causal + window", 5, 7, (5, 0)),
    ("varlen-like", -1, 7, (-1, 0))])
def test_variant_window(variant, left, right, want):
    assert bmw.variant_window(variant, left, right) == want


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="variant"):
        bmw.variant_window("banded")
    with pytest.raises(ValueError, match="lengths"):
        bmw.parse_lengths("3, x")
    with pytest.raises(ValueError, match="at least one"):
        bmw.parse_lengths([4, 0])
    with pytest.raises(ValueError, match="block_m"):
        bmw.block_map_of("causal", 10, 10, 0, 16)
    assert bmw.parse_lengths("37, 100;9 4") == (37, 100, 9, 4)


@pytest.mark.parametrize("variant,n_q,n_k,bm,bn,left,right", [
    ("full", 50, 70, 16, 32, -1, -1), ("causal", 97, 40, 32, 16, -1, -1),
    ("sliding window", 130, 130, 32, 32, 20, 7), ("causal + window", 64, 100, 16, 16, 9, -1),
    ("varlen-like", 0, 0, 16, 8, -1, -1), ("varlen-like", 0, 0, 32, 32, 5, -1)])
def test_the_map_is_the_counts(variant, n_q, n_k, bm, bn, left, right):
    """Every pair the drawn map colours as run (unmasked or masked) is a pair variant_io
    counts as computed; the pairs of the band lie in tiles that run; varlen sums its
    sequences, and only it has pairs between two sequences."""
    lengths = (37, 100, 1, 9)
    n_q, n_k = (n_q or 1), (n_k or 1)
    bm_ = bmw.block_map_of(variant, n_q, n_k, bm, bn, left, right, lengths)
    codes = bmw._codes(bm_)
    assert int(np.isin(codes, (1, 2)).sum()) == bm_.io["computed_pairs"]
    window = bm_.window
    if variant == "varlen-like":
        assert bm_.n_q == bm_.n_k == sum(lengths)
        parts = [variant_io(n, n, bm_.d, bm, bn, window) for n in lengths]
        assert bm_.io["visible_pairs"] == sum(p["visible_pairs"] for p in parts)
        assert bm_.io["blocks"] == {k: sum(p["blocks"][k] for p in parts) for k in bmw.KINDS}
        assert (codes == 3).sum() == sum(lengths) ** 2 - sum(n * n for n in lengths)
        visible = torch.block_diag(*[masks.visible(n, n, window) for n in lengths]).numpy()
    else:
        assert bm_.io == {k: v for k, v in variant_io(n_q, n_k, bm_.d, bm, bn, window).items()
                          if k != "tiles"}
        assert not (codes == 3).any()
        visible = masks.visible(n_q, n_k, window).numpy()
    assert np.isin(codes[visible], (1, 2)).all()
    assert visible[codes == 1].all()  # an unmasked tile: every pair seen


def test_drawings_and_figures():
    from matplotlib.figure import Figure

    from course_lib.diagrams import variants as dv

    fig = bmw.draw_block_map("varlen-like", lengths="5, 40, 17")
    assert len(fig.axes) == 2 and "another sequence" in " ".join(
        t.get_text() for t in fig.axes[0].get_legend().get_texts())
    text = fig.axes[1].texts[0].get_text()
    assert "pairs the rows see" in text and "padded batch (3 × 40)" in text
    for name, make in {**bmw.FIGURES, **dv.FIGURES}.items():
        assert name.startswith("15_")
        made = make()
        assert isinstance(made, Figure) and made.axes, name


def test_widget_redraws_and_greys_out_what_a_variant_ignores():
    w = bmw.block_map_widget()
    first = w.image.value
    assert first[:4] == b"\x89PNG"
    for control, value in ((w.n_q, 300), (w.n_k, 200), (w.left, 10), (w.right, 0),
                           (w.block_m, 16), (w.block_n, 64)):
        before = w.image.value
        control.value = value
        assert w.image.value != before, control.description
    w.variant.value = "causal"
    assert w.left.disabled and w.right.disabled and w.lengths.disabled and not w.n_q.disabled
    w.variant.value = "varlen-like"
    assert w.n_q.disabled and w.n_k.disabled and not w.lengths.disabled and not w.left.disabled
    before = w.image.value
    w.lengths.value = "12, x"
    assert "whole numbers" in w.message.value and w.image.value == before
    w.lengths.value = "12, 30"
    assert w.message.value == "" and w.image.value != before


def test_sink_share_is_the_closed_form_and_the_reference():
    import torch

    from course_lib.diagrams.variants import alibi_slopes, sink_share
    from course_lib.reference import attention_variants

    top = np.array([-5.0, 0.0, 3.0])
    scores = top[:, None] - 0.5 * np.arange(8)
    for sink in (-1.0, 0.0, 2.0):
        want = np.exp(sink) / (np.exp(sink) + np.exp(scores).sum(-1))
        np.testing.assert_allclose(sink_share(top, sink), want, rtol=1e-12)
        # the reference's exp(sink − lse): one query whose q·k are these scores (k = identity)
        q = torch.tensor(scores)[None, None]  # (1, 1, rows, 8)
        k = torch.eye(8, dtype=torch.float64)[None, None]
        sinks = torch.tensor([sink], dtype=torch.float64)
        _, lse = attention_variants(q, k, torch.zeros_like(k), sm_scale=1.0, sinks=sinks,
                                    return_lse=True)
        np.testing.assert_allclose(sink_share(top, sink), torch.exp(sinks - lse[0, 0]).numpy(),
                                   rtol=1e-12)
    assert alibi_slopes(8).tolist() == [2.0 ** -h for h in range(1, 9)]  # Press et al., H = 8


@pytest.mark.parametrize("n,bm,bn,window", [
    (1000, 128, 64, (100, 0)), (300, 32, 16, (5, 9)), (257, 64, 32, (-1, 0)),
    (200, 16, 64, (-1, -1)), (130, 32, 32, (0, -1)), (4096, 128, 64, (1024, 0))])
def test_the_questions_fast_count_is_variant_io(n, bm, bn, window):
    from course_lib.exercises.variants import computed_pairs

    assert computed_pairs(n, bm, bn, window) == variant_io(n, n, 1, bm, bn, window)[
        "computed_pairs"]


def test_the_questions_numbers():
    from course_lib.exercises import variants as ev

    assert round(ev._CEILING_128, 2) == 7.40  # the lesson's 128 × 64 tiles
    assert ev._CEILING_128 < ev._CEILING_64 < ev._CEILING_16 < 8.25  # smaller tiles, closer
