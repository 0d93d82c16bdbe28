"""How one thread block splits its work among its warps: FlashAttention's "split-K" against
FlashAttention-2's "split-Q".

Introduced in notebooks/08_triton_flash_v2.ipynb (section 5). After Dao 2023,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", section 3.3
and its Figure 3 (https://arxiv.org/abs/2307.08691): FlashAttention splits K and V among the 4
warps of a block while every warp sees all of Q, so each warp ends with a partial O for every
row, and the partial results meet in shared memory, are synchronised and added; FlashAttention-2
splits Q among the warps while every warp sees all of K and V, so each warp owns its rows of the
output from start to end and the warps never exchange anything.
"""
from __future__ import annotations

#: one colour per warp (colour-blind safe: Okabe and Ito's palette)
WARP_COLORS = ("#E69F00", "#56B4E9", "#009E73", "#CC79A7")
SHARED = "#d9d9d9"


def _matrix(ax, x, y, w, h, label, split=None, shared_note=None):
    """A w × h rectangle with its lower-left corner at (x, y), optionally cut into 4 warp-coloured
    strips ("rows" or "cols"); ``label`` above it."""
    from matplotlib.patches import Rectangle

    if split is None:
        ax.add_patch(Rectangle((x, y), w, h, fc=SHARED, ec="black", lw=1.4))
    for i, color in enumerate(WARP_COLORS if split else ()):
        if split == "rows":  # warp 1 on top
            part = Rectangle((x, y + h - (i + 1) * h / 4), w, h / 4, fc=color, ec="black", lw=1)
        else:
            part = Rectangle((x + i * w / 4, y), w / 4, h, fc=color, ec="black", lw=1)
        ax.add_patch(part)
    ax.text(x + w / 2, y + h + 0.25, label, ha="center", va="bottom", fontsize=14,
            fontweight="bold")
    if shared_note:
        ax.text(x + w / 2, y + h / 2, shared_note, ha="center", va="center", fontsize=11)


def _panel(ax, split_q: bool):
    from matplotlib.patches import Rectangle

    ax.set_xlim(0, 20)
    ax.set_ylim(-1.6 if split_q else -0.3, 5.3)
    ax.set_aspect("equal")
    ax.axis("off")
    qh, qw = 4.0, 1.4          # Q, V, O: BLOCK rows × d
    kw, kh = 4.0, 1.4          # Kᵀ: d × BLOCK_N
    y0 = 0.0
    if split_q:
        _matrix(ax, 0.0, y0, qw, qh, "Q", split="rows")
        _matrix(ax, 2.2, y0 + qh - kh, kw, kh, "Kᵀ", shared_note="all warps")
        _matrix(ax, 7.0, y0, qw, qh, "V", shared_note="all\nwarps")
        ax.text(9.0, y0 + qh / 2, "→", fontsize=26, ha="center", va="center")
        _matrix(ax, 10.0, y0, qw, qh, "O", split="rows")
        ax.text(12.0, y0 + qh - 0.5, "each warp writes\nits own rows of O:\nno exchange "
                "between warps,\nno shared-memory sum", fontsize=12, va="top")
        ax.set_title("(b) FlashAttention-2, split Q: warp w owns rows of Q, reads all of K and V",
                     fontsize=13, loc="left")
    else:
        _matrix(ax, 0.0, y0, qw, qh, "Q", shared_note="all\nwarps")
        _matrix(ax, 2.2, y0 + qh - kh, kw, kh, "Kᵀ", split="cols")
        _matrix(ax, 7.0, y0, qw, qh, "V", split="rows")
        ax.text(9.0, y0 + qh / 2, "→", fontsize=26, ha="center", va="center")
        for i, color in enumerate(WARP_COLORS):  # four partial O's, one per warp, stacked
            ax.add_patch(Rectangle((10.0 + 0.22 * (3 - i), y0 + 0.22 * (3 - i)),
                                   qw, qh, fc=color, ec="black", lw=1))
        ax.text(10.0 + qw / 2 + 0.33, y0 + qh + 0.25 + 0.66, "4 partial O", ha="center",
                va="bottom", fontsize=14, fontweight="bold")
        ax.annotate("", xy=(16.3, y0 + qh / 2), xytext=(12.3, y0 + qh / 2),
                    arrowprops=dict(arrowstyle="-|>", lw=2, color="black"))
        ax.text(14.3, y0 + qh / 2 + 0.3, "write to shared\nmemory, sync, add", ha="center",
                va="bottom", fontsize=12)
        _matrix(ax, 16.6, y0, qw, qh, "O", shared_note="sum")
        ax.set_title("(a) FlashAttention, split K: warp w owns keys of K and V, reads all of Q",
                     fontsize=13, loc="left")
        return
    for i, color in enumerate(WARP_COLORS):  # the legend, once: a swatch per warp
        ax.add_patch(Rectangle((2.6 * i, -1.45), 0.5, 0.5, fc=color, ec="black", lw=1))
        ax.text(0.65 + 2.6 * i, -1.2, f"warp {i + 1}", va="center", fontsize=12)


def fa2_partitioning():
    """Two panels, one thread block of 4 warps each: split-K (FlashAttention) above, split-Q
    (FlashAttention-2) below, as in Figure 3 of the FlashAttention-2 paper."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 7.6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    _panel(top, split_q=False)
    _panel(bottom, split_q=True)
    fig.suptitle("One thread block, 4 warps: who computes which part of O = softmax(QKᵀ)V",
                 fontsize=14)
    return fig


FIGURES = {"08_fa2_partitioning": fa2_partitioning}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
