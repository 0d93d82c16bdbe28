"""Standard attention as three kernels, each moving its operands through HBM.

Introduced in notebooks/04_attention_io.ipynb. The FlashAttention paper's Algorithm 0 (Dao et
al. 2022, https://arxiv.org/abs/2205.14135): S = QKᵀ, P = softmax(S), O = PV, one kernel each.
Every arrow is one of the 8 HBM operations, labelled with its bytes for one head, computed by
``course_lib.iomodel.attention.standard_attention_steps`` (never typed here).
"""
from __future__ import annotations

FONT = 12
READ, WRITE = "#2f6db5", "#b03a2e"


def _mib(nbytes: float) -> str:
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


def _box(ax, x, y, w, h, color, edge, lw=1.6):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.15",
                                facecolor=color, edgecolor=edge, lw=lw))


def _arrow(ax, x0, y0, x1, y1, color, text, side="left"):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2.2,
                            "mutation_scale": 16, "shrinkA": 0, "shrinkB": 0})
    xm, ym = (x0 + x1) / 2, (y0 + y1) / 2
    ax.text(xm + (-0.22 if side == "left" else 0.22), ym, text, color=color, fontsize=FONT - 1,
            ha="right" if side == "left" else "left", va="center")


def standard_attention_figure(N: int = 4096, d: int = 64, bytes_per_el: int = 2):
    """HBM on top holding Q, K, V, S, P, O (width growing with size); the three kernels below,
    left to right in time; an arrow per read (blue, down) and write (red, up) with its bytes."""
    from matplotlib.figure import Figure

    from course_lib.iomodel.attention import standard_attention_steps

    steps = standard_attention_steps(N, d, bytes_per_el=bytes_per_el)
    nbytes = {}
    for s in steps:
        for name, n in {**s["reads"], **s["writes"]}.items():
            nbytes[name] = n * bytes_per_el
    total = sum(s["hbm_bytes"] for s in steps)
    sp = 4 * N * N * bytes_per_el

    fig = Figure(figsize=(13, 6.2), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 26)
    ax.set_ylim(0, 10.6)
    ax.set_axis_off()

    # HBM and its six tensors: small d-wide ones, the two N×N ones wide
    _box(ax, 0.2, 7.0, 25.6, 3.0, "#fbeeee", "#b03a2e")
    ax.text(0.5, 9.65, f"HBM (one head, N = {N}, d = {d}, fp16)", fontsize=FONT, weight="bold",
            color="#8a2a20", va="center")
    tensors = {"Q": (0.5, 1.9), "K": (2.6, 1.9), "S": (5.6, 6.0), "P": (13.0, 6.0),
               "V": (20.0, 1.9), "O": (23.6, 1.9)}
    for name, (x, w) in tensors.items():
        big = name in "SP"
        _box(ax, x, 7.35, w, 1.9, "#f4c7c3" if big else "white", "0.3")
        text = (f"{name}  ({N}×{N}, {_mib(nbytes[name])})" if big else
                f"{name}\n{N}×{d}\n{_mib(nbytes[name])}")
        ax.text(x + w / 2, 8.3, text, ha="center", va="center", fontsize=FONT,
                weight="bold" if big else "normal", linespacing=1.15)

    # the three kernels, on chip, in time order
    kernels = [("kernel 1\nS = QKᵀ", 2.4), ("kernel 2\nP = softmax(S)", 10.2),
               ("kernel 3\nO = PV", 18.8)]
    for label, x in kernels:
        _box(ax, x, 1.3, 4.4, 2.4, "#e3eef9", "#2f6db5")
        ax.text(x + 2.2, 2.5, label, ha="center", va="center", fontsize=FONT)
    ax.text(0.3, 0.45, "on chip (SRAM): one kernel after another; nothing stays there between "
            "kernels", fontsize=FONT - 1, color="0.35", va="center")
    ax.annotate("", xy=(25.6, 2.5), xytext=(23.6, 2.5),
                arrowprops={"arrowstyle": "-|>", "color": "0.5", "lw": 1.5})
    ax.text(25.6, 3.2, "time", ha="right", fontsize=FONT - 1, color="0.4")

    top, bottom = 7.35, 3.7
    # kernel 1: read Q, K; write S
    _arrow(ax, 1.5, top, 3.1, bottom, READ, f"read Q\n{_mib(nbytes['Q'])}")
    _arrow(ax, 3.4, top, 4.0, bottom, READ, f"read K\n{_mib(nbytes['K'])}", side="right")
    _arrow(ax, 6.3, bottom, 7.2, top, WRITE, f"write S\n{_mib(nbytes['S'])}", side="right")
    # kernel 2: read S; write P
    _arrow(ax, 10.0, top, 11.2, bottom, READ, f"read S\n{_mib(nbytes['S'])}")
    _arrow(ax, 13.6, bottom, 14.8, top, WRITE, f"write P\n{_mib(nbytes['P'])}", side="right")
    # kernel 3: read P, V; write O
    _arrow(ax, 17.6, top, 19.6, bottom, READ, f"read P\n{_mib(nbytes['P'])}")
    _arrow(ax, 20.95, top, 21.6, bottom, READ, f"read V\n{_mib(nbytes['V'])}", side="right")
    _arrow(ax, 23.0, bottom, 24.5, top, WRITE, f"write O\n{_mib(nbytes['O'])}", side="right")

    ax.text(25.8, 10.35, f"8 HBM operations: {_mib(total)} in all, {sp / total:.0%} of it S and P",
            ha="right", va="center", fontsize=FONT, color="0.2")
    return fig


FIGURES = {"04_standard_attention": standard_attention_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
