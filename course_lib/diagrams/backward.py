"""The backward pass's dataflow: what each of the course's three backward kernels reads, keeps on
chip, recomputes and writes.

Introduced in notebooks/10_backward.ipynb (section 5). The kernels are those of
``course_lib.kernels.flash_bwd``: a preprocessing kernel (delta = rowsum(dO ∘ O), lse₂ =
lse·log₂e), a dK/dV kernel (one program per block of keys, FlashAttention-2's loop order) and a
dQ kernel (one program per block of query rows). Triton's tutorial 06 runs the same two loops
one after the other in one program
(https://triton-lang.org/main/getting-started/tutorials/06-fused-attention.html). The matmul
counts in the picture are read from the kernels' source (``dot_lines``), so the picture cannot
drift from the code. References: Dao et al. 2022, "FlashAttention", Appendix B
(https://arxiv.org/abs/2205.14135); Dao 2023, "FlashAttention-2", section 3.1.2 and
Algorithm 2 (https://arxiv.org/abs/2307.08691).
"""
from __future__ import annotations

import inspect

#: role -> (face colour, edge colour) of a tensor chip
ROLE_COLORS = {
    "read": ("#dbe9f6", "#2b6cb0"),      # read from HBM once, kept on chip
    "stream": ("#fde8c8", "#c05621"),    # streamed past, block after block
    "recompute": ("#e9e3f5", "#6b46c1"),  # recomputed on chip, never in HBM
    "write": ("#d9f0dc", "#2f855a"),     # written to HBM once
}
ROLE_LABELS = {
    "read": "loaded once, stays on chip",
    "stream": "streamed past, block by block",
    "recompute": "recomputed on chip (never in HBM)",
    "write": "written to HBM once",
}


def dot_lines(kernel: str) -> list[str]:
    """The source lines of ``flash_bwd``'s inner loop ``kernel`` ("dkdv" or "dq") that call
    ``tl.dot``: one matmul on tiles each (comments left out), in the default two-kernel form
    (the lines under ``if ONE_PASS:`` left out)."""
    from course_lib.kernels import flash_bwd

    fn = {"dkdv": flash_bwd._bwd_dkdv_inner, "dq": flash_bwd._bwd_dq_inner}[kernel].fn
    dots, skip_below = [], None  # the indent of an ``if ONE_PASS:`` whose block is skipped
    for line in inspect.getsource(fn).splitlines():
        code = line.split("#")[0].rstrip()
        indent = len(code) - len(code.lstrip())
        if skip_below is not None and (not code or indent > skip_below):
            continue
        skip_below = indent if code.strip().startswith("if ONE_PASS") else None
        if "tl.dot(" in code:
            dots.append(code.strip())
    return dots


def _chip(ax, x, y, text, role, h=0.62, size=11):
    """A rounded chip around ``text``, its left edge at ``x``; returns where the next one starts.
    The width is the text's own, measured (the axes must be placed before: no layout engine)."""
    from matplotlib.patches import FancyBboxPatch

    face, edge = ROLE_COLORS[role]
    label = ax.text(x, y, text, ha="left", va="center", fontsize=size, zorder=3)
    renderer = ax.figure.canvas.get_renderer()
    box = label.get_window_extent(renderer).transformed(ax.transData.inverted())
    pad = 0.16
    label.set_x(x + pad)
    w = box.width + 2 * pad
    ax.add_patch(FancyBboxPatch((x, y - h / 2), w, h,
                                boxstyle="round,pad=0.02,rounding_size=0.12",
                                fc=face, ec=edge, lw=1.4, zorder=2))
    return x + w + 0.18


def _row(ax, x, y, chips, role, size=11):
    for text in chips:
        x = _chip(ax, x, y, text, role, size=size)
    return x


def backward_dataflow():
    """Three boxes, one per kernel, in launch order: the tensors each reads once, streams,
    recomputes and writes; the matmuls (``tl.dot``) of each counted from the source."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Patch

    n_kv, n_q = len(dot_lines("dkdv")), len(dot_lines("dq"))
    fig = Figure(figsize=(11.0, 6.6))
    FigureCanvasAgg(fig)  # a renderer, to measure the chips' text
    ax = fig.add_axes((0.0, 0.07, 1.0, 0.86))
    ax.set_xlim(0, 22)
    ax.set_ylim(0, 13.2)
    ax.axis("off")

    boxes = [  # x0, width, title, subtitle
        (0.1, 5.0, "1 · preprocess", "a program per block of rows"),
        (5.6, 8.0, "2 · dK, dV", "a program per block of keys K_j, V_j"),
        (14.1, 7.8, "3 · dQ", "a program per block of rows Q_i"),
    ]
    top, bottom = 12.0, 1.1
    for x0, w, title, sub in boxes:
        ax.add_patch(FancyBboxPatch((x0, bottom), w, top - bottom,
                                    boxstyle="round,pad=0.02,rounding_size=0.25",
                                    fc="white", ec="#4a5568", lw=1.6))
        ax.text(x0 + 0.3, top - 0.5, title, fontsize=14, fontweight="bold", va="center")
        ax.text(x0 + 0.3, top - 1.2, sub, fontsize=11, va="center", color="#2d3748")

    # 1 · preprocess: O, dO, lse in; delta and lse₂ out
    x0 = 0.4
    ax.text(x0, 9.9, "reads", fontsize=11, color="#4a5568")
    _row(ax, x0, 9.2, ["O_i", "dO_i", "lse_i"], "read")
    ax.text(x0, 7.8, "computes per row", fontsize=11, color="#4a5568")
    ax.text(x0, 7.0, "delta = rowsum(dO ∘ O)", fontsize=11)
    ax.text(x0, 6.3, "lse₂ = lse · log₂e", fontsize=11)
    ax.text(x0, 5.6, "(−∞ → +∞: P = 0)", fontsize=11, color="#4a5568")
    ax.text(x0, 4.2, "writes", fontsize=11, color="#4a5568")
    _row(ax, x0, 3.5, ["delta", "lse₂"], "write")
    ax.text(x0, 1.7, "0 matmuls", fontsize=12, fontweight="bold")

    # 2 · dK, dV: K_j, V_j stay; Q_i, dO_i, lse₂, delta stream; P, dP, dS recomputed
    x0 = 5.9
    ax.text(x0, 9.9, "on chip for the whole loop", fontsize=11, color="#4a5568")
    x = _row(ax, x0, 9.2, ["K_j", "V_j"], "read")
    _row(ax, x, 9.2, ["dK_j", "dV_j"], "write")
    ax.text(x0, 7.8, "for every Q block i that sees block j", fontsize=11, color="#4a5568")
    _row(ax, x0, 7.1, ["Q_i", "dO_i", "lse₂_i", "delta_i"], "stream")
    ax.text(x0, 5.7, "recomputed, tile by tile (c = τ·log₂e)", fontsize=11, color="#4a5568")
    _row(ax, x0, 5.0, ["Pᵀ = exp2(K_j Q_iᵀ·c − lse₂)", "dPᵀ = V_j dO_iᵀ"], "recompute",
         size=10.5)
    _row(ax, x0, 4.1, ["dSᵀ = Pᵀ ∘ (dPᵀ − delta)"], "recompute", size=10.5)
    ax.text(x0, 3.0, "dV_j += Pᵀ dO_i,   dK_j += τ dSᵀ Q_i", fontsize=11)
    ax.text(x0, 1.7, f"{n_kv} matmuls: S, dP, dV, dK", fontsize=12, fontweight="bold")

    # 3 · dQ: Q_i, dO_i, lse₂, delta stay; K_j, V_j stream; P, dP, dS recomputed again
    x0 = 14.4
    ax.text(x0, 9.9, "on chip for the whole loop", fontsize=11, color="#4a5568")
    x = _row(ax, x0, 9.2, ["Q_i", "dO_i", "lse₂_i", "delta_i"], "read")
    _row(ax, x, 9.2, ["dQ_i"], "write")
    ax.text(x0, 7.8, "for every key block j that row block i sees", fontsize=11,
            color="#4a5568")
    _row(ax, x0, 7.1, ["K_j", "V_j"], "stream")
    ax.text(x0, 5.7, "recomputed again (c = τ·log₂e)", fontsize=11, color="#4a5568")
    _row(ax, x0, 5.0, ["P = exp2(Q_i K_jᵀ·c − lse₂)", "dP = dO_i V_jᵀ"], "recompute",
         size=10.5)
    _row(ax, x0, 4.1, ["dS = P ∘ (dP − delta)"], "recompute", size=10.5)
    ax.text(x0, 3.0, "dQ_i += τ dS K_j", fontsize=11)
    ax.text(x0, 1.7, f"{n_q} matmuls: S, dP, dQ", fontsize=12, fontweight="bold")

    # delta and lse₂ go from kernel 1 to kernels 2 and 3 through HBM
    green = ROLE_COLORS["write"][1]
    ax.plot([2.6, 2.6, 17.9], [bottom, 0.45, 0.45], color=green, lw=1.8)
    for x_to in (9.6, 17.9):
        ax.annotate("", xy=(x_to, bottom), xytext=(x_to, 0.45),
                    arrowprops=dict(arrowstyle="-|>", lw=1.8, color=green))
    ax.text(13.75, 0.72, "delta, lse₂: one fp32 number per row, through HBM", fontsize=11,
            ha="center", color=green)

    fig.suptitle(f"The course's backward: three kernels, {n_kv + n_q} matmuls on tiles (S and dP "
                 "computed twice), nothing of size N_q × N_k in HBM", fontsize=13, y=0.985)
    handles = [Patch(fc=ROLE_COLORS[r][0], ec=ROLE_COLORS[r][1], label=ROLE_LABELS[r])
               for r in ROLE_COLORS]
    fig.legend(handles=handles, loc="lower center", ncols=4, fontsize=11, frameon=False)
    return fig


FIGURES = {"10_backward_dataflow": backward_dataflow}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
