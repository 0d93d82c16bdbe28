"""Split-KV and the LSE merge for one head: where the keys go, what each split returns, how the
merge weighs the splits.

Introduced in notebooks/12_flash_decoding.ipynb. ``draw_split_kv`` draws one query row of one
head attending to ``L`` keys cut the way ``course_lib.kernels.decode`` cuts them
(``split_bounds``: whole BLOCK_N tiles per split, the last splits possibly empty; a plan of many
long splits deals the tiles round-robin instead, lesson 12 section 5). The same
function draws the static figure (``split_kv_figure``) and every frame of the sliders
(``split_kv_widget``).

Each split s computes, alone, its partial softmax over its keys:

    m_s = max_j s_j,  l_s = Σ_j e^{s_j − m_s},  o_s = Σ_j e^{s_j − m_s} v_j / l_s,
    lse_s = m_s + log l_s,

and the merge needs nothing else:

    lse = log Σ_s e^{lse_s},   o = Σ_s e^{lse_s − lse} · o_s.

The weights w_s = e^{lse_s − lse} are each split's share of the softmax mass; they sum to 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from course_lib.kernels.decode import split_bounds
from course_lib.testing import below


@dataclass(frozen=True)
class SplitKV:
    """One row's split-KV computation (NumPy, float64)."""

    scores: np.ndarray      # (L,) scaled scores s_j = sm_scale · q·k_j
    values: np.ndarray      # (L, D)
    bounds: list            # [(start, end)] per split
    m: np.ndarray           # (S,) per-split max (-inf for an empty split)
    lse: np.ndarray         # (S,) per-split log-sum-exp (-inf for an empty split)
    o: np.ndarray           # (S, D) per-split normalised output (0 for an empty split)
    weights: np.ndarray     # (S,) merge weights e^{lse_s − lse}
    merged: np.ndarray      # (D,) merged output
    merged_lse: float
    reference: np.ndarray   # (D,) softmax(scores) @ values, in one pass
    reference_lse: float


def split_kv(L: int = 100, num_splits: int = 4, block_n: int = 16, head_dim: int = 4,
             seed: int = 0, scale: float = 1.0) -> SplitKV:
    """Random q, K, V for one head; the split-KV partials, their merge, and the reference."""
    if L < 1:
        raise ValueError(f"L must be >= 1, got {L}")
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(head_dim)
    k = rng.standard_normal((L, head_dim))
    v = rng.standard_normal((L, head_dim))
    s = (k @ q) * scale * head_dim ** -0.5 * 2.0  # a little spread, so the splits differ
    bounds = split_bounds(L, num_splits, block_n)
    m = np.full(num_splits, -np.inf)
    lse = np.full(num_splits, -np.inf)
    o = np.zeros((num_splits, head_dim))
    for i, (lo, hi) in enumerate(bounds):
        if lo >= hi:
            continue
        m[i] = s[lo:hi].max()
        p = np.exp(s[lo:hi] - m[i])
        lse[i] = m[i] + np.log(p.sum())
        o[i] = p @ v[lo:hi] / p.sum()
    top = lse.max()
    weights = np.where(np.isfinite(lse), np.exp(lse - top), 0.0)
    merged_lse = float(top + np.log(weights.sum()))
    weights = weights / weights.sum()
    merged = weights @ o
    p = np.exp(s - s.max())
    reference = p @ v / p.sum()
    return SplitKV(s, v, bounds, m, lse, o, weights, merged, merged_lse, reference,
                   float(s.max() + np.log(p.sum())))


_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def draw_split_kv(L: int = 100, num_splits: int = 4, block_n: int = 16, seed: int = 0,
                  fig=None):
    """Draw the split-KV partition and the LSE merge of one head into ``fig`` and return it.

    Top: the scores along the sequence, coloured by split, each split's max m_s; tile edges
    dotted. Middle: each split's lse_s and its merge weight. Bottom: each split's partial
    output o_s (first 4 dims), the merged output and the one-pass reference.
    """
    import matplotlib.pyplot as plt

    r = split_kv(L, num_splits, block_n, seed=seed)
    if fig is None:
        fig = plt.figure(figsize=(8, 7), layout="constrained")
    ax_s, ax_w, ax_o = fig.subplots(3, 1, gridspec_kw={"height_ratios": [1.3, 1, 1]})
    j = np.arange(L)
    for i, (lo, hi) in enumerate(r.bounds):
        c = _COLORS[i % len(_COLORS)]
        if lo < hi:
            ax_s.bar(j[lo:hi], r.scores[lo:hi], width=1.0, color=c, alpha=0.75,
                     label=f"split {i}: keys {lo}…{hi - 1}")
            ax_s.hlines(r.m[i], lo - 0.5, hi - 0.5, color=c, lw=2)
    for edge in range(0, L, block_n):
        ax_s.axvline(edge - 0.5, color="0.6", ls=":", lw=0.8)
    empty = sum(lo >= hi for lo, hi in r.bounds)
    ax_s.set(xlim=(-0.5, L - 0.5), ylabel="score s_j",
             title=f"L = {L} keys, BLOCK_N = {block_n}, {num_splits} splits"
                   + (f" ({empty} empty)" if empty else "") + ": bars = scores, lines = m_s")
    if num_splits <= 8:
        ax_s.legend(fontsize=10, ncol=2, loc="lower right")

    x = np.arange(num_splits)
    colors = [_COLORS[i % len(_COLORS)] for i in x]
    finite = np.isfinite(r.lse)
    ax_w.bar(x[finite] - 0.2, r.lse[finite], width=0.4, color=np.array(colors)[finite],
             alpha=0.45, hatch="//", label="lse_s (left axis)")
    ax_w.axhline(r.merged_lse, color="k", lw=1, ls="--", label=f"merged lse = {r.merged_lse:.3f}")
    ax_w.set(xticks=x, xticklabels=[f"split {i}" + ("" if finite[i] else "\n(empty)") for i in x],
             ylabel="lse_s",
             title=f"merge: weights e^(lse_s − lse) sum to {r.weights.sum():.3f}; "
                   f"one-pass lse = {r.reference_lse:.3f}")
    ax_wt = ax_w.twinx()
    ax_wt.bar(x + 0.2, r.weights, width=0.4, color=colors, label="weight (right axis)")
    ax_wt.set(ylim=(0, 1.05), ylabel="weight")
    handles = ax_w.get_legend_handles_labels()
    more = ax_wt.get_legend_handles_labels()
    ax_w.legend(handles[0] + more[0], handles[1] + more[1], fontsize=10, loc="upper right")

    dims = np.arange(min(4, r.o.shape[1]))
    for i in x:
        if finite[i]:
            ax_o.scatter(dims + (i - num_splits / 2) * 0.04, r.o[i, dims], color=colors[i],
                         s=12 + 200 * r.weights[i], alpha=0.7)
    ax_o.scatter(dims, r.merged[dims], marker="_", s=900, color="k", lw=2,
                 label="merged Σ w_s·o_s")
    ax_o.scatter(dims, r.reference[dims], marker="x", s=80, color="tab:red",
                 label="reference softmax(s)·V")
    err = below(np.abs(r.merged - r.reference).max(), 1e-12)  # fp64: zero up to rounding
    ax_o.set(xticks=dims, xticklabels=[f"o[{d}]" for d in dims], ylabel="value",
             title=f"partial outputs o_s (dot size = weight); |merged − reference| {err}")
    ax_o.legend(fontsize=10, loc="lower right")
    return fig


def split_kv_figure():
    """The static figure: 100 keys, 16-key tiles, 4 splits (the last one short)."""
    return draw_split_kv(100, 4, 16, seed=0)


def split_kv_widget(L: int = 100, num_splits: int = 4, block_n: int = 16, seed: int = 0):
    """Sliders for L, the number of splits, BLOCK_N and the random seed; each change redraws
    ``draw_split_kv``.

    Needs a widget frontend (JupyterLab, VS Code, Colab) to be interactive; elsewhere use
    ``split_kv_figure`` or ``draw_split_kv``, which draw the same pictures.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    length = widgets.IntSlider(value=L, min=1, max=256, description="L",
                               continuous_update=False)
    splits = widgets.IntSlider(value=num_splits, min=1, max=10, description="splits",
                               continuous_update=False)
    tile = widgets.Dropdown(options=[8, 16, 32, 64], value=block_n, description="BLOCK_N")
    rng_seed = widgets.IntSlider(value=seed, min=0, max=20, description="seed",
                                 continuous_update=False)
    out = widgets.Output()

    def redraw(_change=None):
        with out:
            out.clear_output(wait=True)
            fig = draw_split_kv(length.value, splits.value, tile.value, rng_seed.value)
            display(fig)
            plt.close(fig)

    for w in (length, splits, tile, rng_seed):
        w.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([length, splits]), widgets.HBox([tile, rng_seed]), out])


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"12_split_kv_merge": split_kv_figure}
