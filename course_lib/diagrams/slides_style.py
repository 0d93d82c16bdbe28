"""Shared drawing rules of the slide figures (the ``slides_*`` stems of this package).

A slide figure is drawn at the size it takes on a 1280×720 slide: ``slide_figure(w, h)`` makes
a Figure of ``w × h`` slide pixels (one inch per 100 px). Saved at the course's 110 dpi and
drawn ``w`` px wide, a font of ``pt`` points lands at ``pt × 110/72 × w / (1.1·w) ≈ 1.39·pt``
slide pixels, so ``MIN_PT = 14`` gives about 19 px, above ``course_lib.slides.MIN_TEXT_PX``
(18 px). The decks place each figure with ``![w:<w>](...)`` at the width it was drawn for.

Used by every ``course_lib/diagrams/slides_<deck>.py``; draws nothing itself.
"""
from __future__ import annotations

#: Font sizes in points: the smallest text of a slide figure, ordinary labels, titles.
MIN_PT = 14
LABEL_PT = 16
TITLE_PT = 18

#: The course's colours for the recurring things (as in the notebooks' figures).
C_MAX = "#c0392b"     # the running max m
C_SUM = "#27ae60"     # the running sum d / l
C_OLD = "#2e86c1"     # terms already summed
C_NEW = "#e67e22"     # the block being merged
C_HBM = "#8e44ad"     # HBM / DRAM traffic
C_SRAM = "#16a085"    # on-chip memory
GREY = "0.6"

FIGURES: dict = {}
"""This module draws no figure of its own (``course_lib.figures`` requires the dict)."""


def slide_figure(width_px: float, height_px: float, **kwargs):
    """A Figure of ``width_px × height_px`` slide pixels, with constrained layout."""
    from matplotlib.figure import Figure

    kwargs.setdefault("layout", "constrained")
    return Figure(figsize=(width_px / 100, height_px / 100), **kwargs)


def style_axes(ax, grid: bool = True) -> None:
    """Large tick labels, no top/right spines, a light grid."""
    ax.tick_params(labelsize=MIN_PT)
    ax.xaxis.label.set_size(LABEL_PT)
    ax.yaxis.label.set_size(LABEL_PT)
    ax.title.set_size(TITLE_PT)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if grid:
        ax.grid(True, which="major", alpha=0.3)


def legend(ax, **kwargs):
    """A legend at slide size (``MIN_PT``), without a frame."""
    kwargs.setdefault("fontsize", MIN_PT)
    kwargs.setdefault("frameon", False)
    return ax.legend(**kwargs)


def box(ax, x, y, w, h, text="", color="white", edge="0.25", fontsize=LABEL_PT, lw=1.5,
        text_color="black", weight="normal", **kwargs):
    """A rounded box with centred text in data coordinates (for block diagrams)."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor=edge, lw=lw, **kwargs))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=text_color, weight=weight)


def arrow(ax, xy_from, xy_to, color="0.25", lw=2.0, style="-|>", **kwargs):
    """A straight arrow between two points in data coordinates."""
    ax.annotate("", xy=xy_to, xytext=xy_from,
                arrowprops={"arrowstyle": style, "color": color, "lw": lw,
                            "shrinkA": 0, "shrinkB": 0, **kwargs})


def off(ax) -> None:
    """No frame and no ticks: an axes used as a canvas (its hidden tick labels would still
    count as the figure's smallest text in ``figures.figure_content``)."""
    ax.axis("off")
    ax.set_xticks([])
    ax.set_yticks([])


def blank(ax, xlim, ylim) -> None:
    """An axes used as a drawing canvas: fixed limits, no frame, no ticks."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    off(ax)


def enlarged(fig, factor: float = 1.3, min_pt: float = 15.0):
    """A notebook figure's texts enlarged for a slide: every font times ``factor``, at least
    ``min_pt``. For figures whose layout is in data coordinates (block diagrams), which the
    larger text does not move; the deck draws the result at its natural width or more."""
    from matplotlib.text import Text

    for ax in fig.axes:
        if not ax.axison:   # a canvas: its hidden tick labels would count as text
            ax.set_xticks([])
            ax.set_yticks([])
    for t in fig.findobj(Text):
        if t.get_text().strip():
            t.set_fontsize(max(min_pt, t.get_fontsize() * factor))
    return fig
