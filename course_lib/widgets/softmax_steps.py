"""Step through online softmax: the running m and d, the rescale factor, the partial sums.

Introduced in notebooks/01_softmax.ipynb. ``draw_step`` draws one step of the blocked online
softmax of a row (block size 1: element by element). The same function draws the static
figure (``steps_figure``: a few steps side by side, for slides and for notebooks opened
without a widget frontend) and every frame of the slider (``online_softmax_widget``).

Each step merges one block's (m_block, d_block) into the running state (m, d) with
``course_lib.softmax.merge_md``, starting from the identity (-inf, 0):

    m_new = max(m_old, m_block)
    d_new = d_old·e^{m_old − m_new} + d_block·e^{m_block − m_new}

The first factor is the *rescale*: when the maximum grows, every term already summed into d
shrinks by e^{m_old − m_new}.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from course_lib.softmax import block_md, merge_md

#: A row whose maximum grows several times (steps 2, 4 and 7): the rescale is visible.
DEMO_ROW = np.array([0.5, 1.8, -0.3, 3.1, 2.2, 0.0, 4.0, -1.2, 3.5, 1.0])


@dataclass(frozen=True)
class Step:
    """One merge of the blocked online softmax of a row: elements [lo, hi) enter the state."""

    k: int
    lo: int
    hi: int
    m_old: float
    d_old: float
    m_block: float
    d_block: float
    m_new: float
    d_new: float

    @property
    def rescale(self) -> float:
        """e^{m_old − m_new}: the factor the partial sum d_old is multiplied by (0 at the start)."""
        return _exp_diff(self.m_old, self.m_new)

    @property
    def block_scale(self) -> float:
        """e^{m_block − m_new}: the factor of the new block's own sum d_block."""
        return _exp_diff(self.m_block, self.m_new)


def _exp_diff(a: float, b: float) -> float:
    return math.exp(a - b) if b != -math.inf else 0.0


def _row(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x must be one non-empty row (1-D), got shape {x.shape}")
    return x


def trace(x, block_size: int = 1) -> list[Step]:
    """Every step of the blocked online softmax of the row ``x`` (block_size 1: per element)."""
    x = _row(x)
    m_b, d_b = block_md(x, block_size)  # (n_blocks,), (n_blocks,)
    steps, m, d = [], -math.inf, 0.0
    for k in range(m_b.shape[-1]):
        m_new, d_new = merge_md(m, d, m_b[k], d_b[k])
        lo = k * block_size
        steps.append(Step(k, lo, min(lo + block_size, x.size), m, d, float(m_b[k]),
                          float(d_b[k]), float(m_new), float(d_new)))
        m, d = float(m_new), float(d_new)
    return steps


def draw_step(x, k: int, block_size: int = 1, fig=None):
    """Draw step ``k`` into ``fig`` (a Figure or SubFigure; a new Figure if None) and return it.

    Top: the row, the block being merged, m_old and m_new. Middle: the partial sums, each seen
    element's term e^{x_j − m_new} (outlined: the same terms before the rescale, e^{x_j − m_old}).
    Bottom: m and d after every step so far, with the update written out.
    """
    import matplotlib.pyplot as plt

    x = _row(x)
    steps = trace(x, block_size)
    if not 0 <= k < len(steps):
        raise ValueError(f"k must be in [0, {len(steps) - 1}], got {k}")
    st = steps[k]
    if fig is None:
        fig = plt.figure(figsize=(6.4, 6.4), layout="constrained")
    ax_x, ax_e, ax_md = fig.subplots(3, 1, gridspec_kw={"height_ratios": [1.1, 1.1, 1]})
    j = np.arange(x.size)
    seen, current = j < st.lo, (j >= st.lo) & (j < st.hi)

    colors = np.where(current, "C1", np.where(seen, "C0", "0.85"))
    ax_x.bar(j, x, color=colors)
    if st.m_old != -math.inf:
        ax_x.axhline(st.m_old, color="C0", ls="--", lw=1, label=f"m_old = {st.m_old:.2f}")
    ax_x.axhline(st.m_new, color="C3", lw=1.5, label=f"m_new = {st.m_new:.2f}")
    entering = (f"element {st.lo} enters" if st.hi - st.lo == 1
                else f"elements {st.lo}…{st.hi - 1} enter")
    # headroom above the row's maximum for the legend, so that it covers no bar and no line
    lo_y, hi_y = min(0.0, x.min()), max(0.0, x.max())
    span = max(hi_y - lo_y, 1e-9)
    ax_x.set(title=f"step {k + 1}/{len(steps)}: {entering}", ylabel="x_j", xticks=j,
             ylim=(lo_y - 0.1 * span, hi_y + 0.45 * span))
    ax_x.legend(loc="upper left", ncol=2, fontsize=8)

    done = j < st.hi
    terms = np.where(done, np.exp(x - st.m_new), 0.0)
    ax_e.bar(j, terms, color=np.where(current, "C1", "C0"))
    if st.m_old != -math.inf:
        before = np.where(seen, np.exp(x - st.m_old), 0.0)
        ax_e.bar(j[seen], before[seen], fill=False, edgecolor="0.3", ls=":", lw=1)
    ax_e.set(ylabel="e^(x_j − m_new)", xticks=j, ylim=(0, 1.15),
             title=f"partial sum d = Σ bars = {st.d_new:.4f}")

    ks = np.arange(len(steps))
    ms = np.array([s.m_new for s in steps])
    ds = np.array([s.d_new for s in steps])
    ax_md.plot(ks[:k + 1], ms[:k + 1], "o-", color="C3", label="m")
    ax_md.plot(ks[:k + 1], ds[:k + 1], "s-", color="C2", label="d")
    ax_md.set(xlim=(-0.5, len(steps) - 0.5), ylim=(min(0.0, ms.min()) - 0.3,
                                                    max(ms.max(), ds.max()) + 0.6),
              xticks=ks, xticklabels=[str(i + 1) for i in ks], xlabel="step")
    ax_md.legend(loc="upper left", fontsize=8)
    ax_md.text(0.99, 0.04, f"rescale e^(m_old − m_new) = {st.rescale:.3f}\n"
               f"d = {st.d_old:.3f}·{st.rescale:.3f} + {st.d_block:.3f}·{st.block_scale:.3f}"
               f" = {st.d_new:.3f}", transform=ax_md.transAxes, ha="right", va="bottom",
               fontsize=8, family="monospace")
    return fig


def steps_figure(x=DEMO_ROW, block_size: int = 1, steps=None):
    """A static figure: ``draw_step`` for several steps side by side (default: four of them)."""
    import matplotlib.pyplot as plt

    n = len(trace(x, block_size))
    ks = sorted(set(steps)) if steps is not None else sorted({0, n // 3, (2 * n) // 3, n - 1})
    fig = plt.figure(figsize=(4.6 * len(ks), 6.4), layout="constrained")
    subfigs = np.atleast_1d(fig.subfigures(1, len(ks)))
    for sub, k in zip(subfigs, ks):
        draw_step(x, k, block_size, fig=sub)
    return fig


def online_softmax_widget(x=DEMO_ROW, block_size: int = 1):
    """A slider over the steps (and one over the block size) that redraws with ``draw_step``.

    Needs a widget frontend (JupyterLab, VS Code, Colab) to be interactive; elsewhere use
    ``steps_figure``, which draws the same pictures.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    x = _row(x)
    step = widgets.IntSlider(value=0, min=0, max=len(trace(x, block_size)) - 1,
                             description="step", continuous_update=False)
    block = widgets.IntSlider(value=block_size, min=1, max=x.size, description="block size",
                              continuous_update=False)
    out = widgets.Output()

    def redraw(_change=None):
        step.max = len(trace(x, block.value)) - 1
        with out:
            out.clear_output(wait=True)
            fig = draw_step(x, min(step.value, step.max), block.value)
            display(fig)
            plt.close(fig)

    step.observe(redraw, names="value")
    block.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([step, block]), out])


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {
    "01_online_softmax_steps": lambda: steps_figure(DEMO_ROW, 1, steps=(0, 1, 3, 6)),
    "01_blocked_softmax_steps": lambda: steps_figure(DEMO_ROW, 4),
}
