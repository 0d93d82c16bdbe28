"""Slide figures of deck 06 (the backward pass): what is kept, the five formulas as a
dataflow, the three kernels and their matmuls, traffic, measured memory, measured speed.

Drawn for slides/06_backward.md at slide size (``slides_style``) from the same code and data as
notebooks/10_backward.ipynb: ``iomodel.backward.theorem5_io`` (Algorithm 3 against Algorithm 4),
and the H100 measurements course_lib/data/memory.json and attention_bwd.json.
"""
from __future__ import annotations

from course_lib.diagrams.slides_style import (
    C_HBM,
    C_MAX,
    C_NEW,
    C_OLD,
    C_SUM,
    GREY,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    arrow,
    blank,
    box,
    legend,
    slide_figure,
    style_axes,
)


def matmul_counts() -> dict:
    """``tl.dot`` calls in the inner loops of the course's backward kernels, counted in their
    source (course_lib/kernels/flash_bwd.py, the default two-kernel form:
    ``diagrams.backward.dot_lines``): the dK/dV loop and the dQ loop."""
    from course_lib.diagrams.backward import dot_lines

    dkdv, dq = len(dot_lines("dkdv")), len(dot_lines("dq"))
    return {"dkdv": dkdv, "dq": dq, "total": dkdv + dq}


def formulas():
    """The five gradient formulas as a dataflow (notebooks/10_backward.ipynb): the
    forward's three lines on top, as the backward redoes them (S and P recomputed from Q, K and
    the lse; O saved); the backward below, the chain rule from O back to S. Five matmuls
    (numbered, filled), the rest elementwise."""
    fig = slide_figure(1160, 450)
    ax = fig.subplots()
    blank(ax, (0, 11.6), (0, 4.5))
    w, h = 3.1, 0.72
    xs = (0.15, 4.05, 7.95)          # the columns of S, P, O
    top, mid, low = 3.05, 1.75, 0.6  # the boxes' lower edges
    mm, ew = "#d6eaf8", "white"      # matmul, elementwise

    def node(col, y, text, fill, edge="0.25", ls="-", color="black", weight="normal"):
        box(ax, xs[col], y, w, h, text, color=fill, edge=edge, linestyle=ls,
            text_color=color, weight=weight)

    ax.text(0.15, 4.2, "forward, as the backward redoes it: S and P recomputed, O saved",
            fontsize=LABEL_PT, color="0.3", va="center")
    node(0, top, "① S = τ Q Kᵀ", mm, edge=C_MAX, weight="bold")
    node(1, top, "P = exp(S − lse)", ew, edge=C_MAX, ls="--")
    node(2, top, "O = P V: saved", "0.92", edge="0.6", color="0.35")
    for a, b in ((0, 1), (1, 2)):
        arrow(ax, (xs[a] + w, top + h / 2), (xs[b], top + h / 2), color="0.5")
    node(2, mid, "② dV = Pᵀ dO", mm, weight="bold")
    node(2, low, "③ dP = dO Vᵀ", mm, weight="bold")
    node(1, mid, "dS = P ∘ (dP − delta)", ew, ls="--")
    node(1, low, "delta = rowsum(dO ∘ O)", ew, ls="--")
    node(0, mid, "④ dQ = τ dS K", mm, weight="bold")
    node(0, low, "⑤ dK = τ dSᵀ Q", mm, weight="bold")
    # P feeds dV and dS; dP and delta feed dS; dS feeds dQ and dK
    arrow(ax, (xs[1] + w, top + 0.15), (xs[2], mid + h - 0.1), color=C_OLD)
    arrow(ax, (xs[1] + w / 2, top), (xs[1] + w / 2, mid + h), color=C_OLD)
    ax.text(xs[1] + w / 2 + 0.1, (top + mid + h) / 2, "P", fontsize=LABEL_PT, color=C_OLD,
            va="center")
    arrow(ax, (xs[1] + w / 2, low + h), (xs[1] + w / 2, mid), color=C_OLD)
    arrow(ax, (xs[2], low + h - 0.1), (xs[1] + w, mid + 0.1), color=C_OLD)
    arrow(ax, (xs[1], mid + h / 2), (xs[0] + w, mid + h / 2), color=C_OLD)
    arrow(ax, (xs[1], mid + 0.1), (xs[0] + w, low + h - 0.1), color=C_OLD)
    arrow(ax, (11.55, (mid + low + h) / 2), (xs[2] + w, (mid + low + h) / 2), color=C_NEW)
    ax.text(11.5, (mid + low + h) / 2 - 0.28, "dO", fontsize=LABEL_PT, color=C_NEW,
            weight="bold", ha="right", va="center")
    ax.text(0.15, 0.2, "backward, from O back to S:  ①–⑤ matmuls (filled),  dashed: "
            "elementwise,  red edge: recomputed", fontsize=MIN_PT, color="0.3", va="center")
    return fig


def matmuls():
    """Matmuls per pair of a query block and a key block, three ways to organise the backward:
    keep P (4), recompute S once with an atomic dQ (FlashAttention-2's backward, 5), or the
    course's two passes (counted in course_lib/kernels/flash_bwd.py)."""
    n = matmul_counts()
    keep = ["dV", "dP", "dQ", "dK"]
    rows = [("keep P\n(standard backward)", [("", keep)], "P read back from HBM: N² per head"),
            ("recompute S once\n(FlashAttention-2)", [("", ["S"] + keep)],
             "dQ by atomic adds: the order of the sums varies"),
            ("two passes\n(the course)",
             [("dK/dV kernel", ["Sᵀ", "dV", "dPᵀ", "dK"][:n["dkdv"]]),
              ("dQ kernel", ["S", "dP", "dQ"][:n["dq"]])],
             "no atomics: every gradient written once, reproducible")]
    fig = slide_figure(1160, 380)
    ax = fig.subplots()
    blank(ax, (0, 11.6), (0, 3.8))
    sq, gap, x0 = 0.56, 0.08, 3.0
    box(ax, x0, 3.45, 0.3, 0.26, "", color=C_MAX)
    ax.text(x0 + 0.4, 3.58, "recomputed", fontsize=MIN_PT, va="center")
    box(ax, x0 + 2.1, 3.45, 0.3, 0.26, "", color="#d6eaf8")
    ax.text(x0 + 2.5, 3.58, "makes a gradient", fontsize=MIN_PT, va="center")
    ax.text(9.75, 3.58, "matmuls", fontsize=MIN_PT, color="0.3", va="center", ha="right")
    ax.text(9.95, 3.58, "FLOPs", fontsize=MIN_PT, color="0.3", va="center")
    for r, (label, groups, note) in enumerate(rows):
        y = 2.55 - 1.2 * r
        ax.text(0.1, y + sq / 2, label, fontsize=LABEL_PT, weight="bold", va="center",
                linespacing=1.3)
        x, count = x0, 0
        for gname, names in groups:
            if gname:
                ax.text(x, y + sq + 0.17, gname, fontsize=MIN_PT, color="0.3", va="center")
            for name in names:
                redo = name.rstrip("ᵀ") == "S" or (gname == "dQ kernel" and name == "dP")
                box(ax, x, y, sq, sq, name, color=C_MAX if redo else "#d6eaf8",
                    text_color="white" if redo else "black", fontsize=MIN_PT, weight="bold")
                x += sq + gap
                count += 1
            x += 0.3
        ax.text(x0, y - 0.2, note, fontsize=MIN_PT, color="0.3", va="center")
        ax.text(9.75, y + sq / 2, f"{count}", fontsize=TITLE_PT + 6, weight="bold",
                va="center", ha="right")
        ax.text(9.95, y + sq / 2, f"× {count / len(keep):.2f}", fontsize=LABEL_PT + 2,
                va="center")
    return fig


def dataflow():
    """The course's backward as three kernels: what each program keeps on chip, what it
    recomputes, and its matmuls (counted in the kernels' source)."""
    n = matmul_counts()
    fig = slide_figure(1160, 400)
    ax = fig.subplots()
    blank(ax, (0, 11.6), (0, 4.0))
    cols = [(0.05, 3.1, "1 · preprocess", "a program per row block",
             ["delta = rowsum(dO ∘ O)", "lse₂ = lse · log₂e"], "0 matmuls", "0.92"),
            (3.3, 4.0, "2 · dK, dV", "a program per key block Kⱼ, Vⱼ",
             ["Pᵀ = 2^(Kⱼ Qᵢᵀ·c − lse₂)", "dPᵀ = Vⱼ dOᵢᵀ", "dVⱼ += Pᵀ dOᵢ",
              "dKⱼ += τ dSᵀ Qᵢ"], f"{n['dkdv']} matmuls", "#d6eaf8"),
            (7.45, 4.1, "3 · dQ", "a program per row block Qᵢ",
             ["P = 2^(Qᵢ Kⱼᵀ·c − lse₂)", "dP = dOᵢ Vⱼᵀ", "dQᵢ += τ dS Kⱼ"],
             f"{n['dq']} matmuls", "#fdebd0")]
    for x, w, title, who, lines, count, color in cols:
        box(ax, x, 0.75, w, 3.2, "", color=color)
        ax.text(x + 0.15, 3.6, title, fontsize=TITLE_PT, weight="bold", va="center")
        ax.text(x + 0.15, 3.15, who, fontsize=MIN_PT, color="0.3", va="center")
        for i, line in enumerate(lines):
            ax.text(x + 0.15, 2.6 - 0.42 * i, line, fontsize=LABEL_PT, va="center")
        ax.text(x + 0.15, 0.95, count, fontsize=LABEL_PT, weight="bold", va="center",
                color=C_MAX if count[0] != "0" else "0.3")
    arrow(ax, (1.55, 0.75), (1.55, 0.35), color=C_SUM)
    ax.plot([1.55, 9.5], [0.35, 0.35], color=C_SUM, lw=2)
    for x in (5.2, 9.5):
        arrow(ax, (x, 0.35), (x, 0.75), color=C_SUM)
    ax.text(3.0, 0.12, "delta, lse₂: one fp32 number per row, through HBM", fontsize=MIN_PT,
            color=C_SUM, va="center")
    return fig


def dkdv_loop(n_blocks: int = 4, i_now: int = 2, j: int = 1):
    """One dK/dV program (``_bwd_dkdv_inner`` of course_lib/kernels/flash_bwd.py): K_j and V_j
    and two fp32 accumulators stay on chip while Q_i, dO_i and their lse, delta stream past,
    one row block per step; dK_j and dV_j are written once, after the loop. The loop order of
    FlashAttention-2's backward (Dao 2023, section 3.2), with the course's matmuls per step."""
    from matplotlib.patches import Rectangle

    n = matmul_counts()
    fig = slide_figure(1160, 440)
    ax = fig.subplots()
    blank(ax, (0, 12.4), (0, 4.6))
    ax.text(0.15, 4.3, "HBM", fontsize=TITLE_PT, weight="bold", color=C_HBM, va="center")

    def stack(x, name, now, color, text_color):
        for b in range(n_blocks):
            y = 3.0 - 0.7 * b
            cur = b == now
            ax.add_patch(Rectangle((x, y), 0.65, 0.6, facecolor=color if cur else "white",
                                   edgecolor="0.3", lw=1.5))
            ax.text(x + 0.325, y + 0.3, name + (("ⱼ" if name in "KV" else "ᵢ") if cur else ""),
                    fontsize=MIN_PT, ha="center", va="center", weight="bold" if cur else "normal",
                    color=text_color if cur else "black")

    stack(0.2, "K", j, C_OLD, "white")
    stack(0.95, "V", j, C_OLD, "white")
    stack(1.95, "Q", i_now, C_NEW, "black")
    stack(2.7, "dO", i_now, C_NEW, "black")
    ax.text(2.68, 0.45, "i = 0, 1, 2, …\none per step", fontsize=MIN_PT, ha="center",
            va="center", color=C_NEW)
    ax.text(0.92, 0.45, "block j\nstays", fontsize=MIN_PT, ha="center", va="center",
            color=C_OLD)
    # on chip: one program
    box(ax, 3.75, 0.7, 4.2, 3.55, "", color="#eef6f2", edge=C_SUM)
    ax.text(3.9, 3.95, "on chip: one program", fontsize=MIN_PT, weight="bold",
            va="center", color=C_SUM)
    box(ax, 3.95, 2.55, 1.8, 1.0, "Qᵢ, dOᵢ\nthis step", color=C_NEW, fontsize=MIN_PT)
    box(ax, 5.95, 2.55, 1.8, 1.0, "Kⱼ, Vⱼ\nloaded once", color=C_OLD, text_color="white",
        fontsize=MIN_PT)
    box(ax, 3.95, 0.9, 3.8, 1.25, "dKⱼ, dVⱼ: fp32 accumulators,\nwritten once, after the loop",
        color="white", fontsize=MIN_PT)
    arrow(ax, (3.4, 1.9), (3.95, 2.7), color=C_NEW)
    arrow(ax, (6.85, 0.9), (6.85, 0.3), color=C_HBM)
    ax.text(7.0, 0.33, "to HBM", fontsize=MIN_PT, color=C_HBM, va="center")
    # each step
    ax.text(8.25, 3.95, f"each step: {n['dkdv']} matmuls", fontsize=TITLE_PT, weight="bold",
            va="center")
    steps = ["Pᵀ = 2^(c·Kⱼ Qᵢᵀ − lse₂)", "dVⱼ += Pᵀ dOᵢ", "dPᵀ = Vⱼ dOᵢᵀ",
             "dSᵀ = Pᵀ ∘ (dPᵀ − delta)", "dKⱼ += dSᵀ Qᵢ"]
    for k, line in enumerate(steps):
        ax.text(8.25, 3.35 - 0.48 * k, line, fontsize=LABEL_PT, va="center")
    ax.text(8.25, 0.85, "after the loop: dKⱼ ×= τ", fontsize=MIN_PT, va="center")
    ax.text(8.25, 0.4, "c = τ·log₂e; lse₂, delta:\none number per row of Qᵢ", fontsize=MIN_PT,
            color="0.3", va="center")
    return fig


def kept(N: int = 16384, d: int = 64, H: int = 16):
    """What one layer keeps for its backward at N = 16k, 16 heads, fp16, drawn to scale: P
    (N × N per head, ``iomodel.backward.recompute_tradeoff``) against O (N × d per head) and
    the lse (one fp32 number per row)."""
    from matplotlib.patches import Rectangle

    from course_lib.iomodel.backward import recompute_tradeoff

    t = recompute_tradeoff(N, d, B=1, H=H)
    o_bytes = N * d * H * 2

    def size(b):
        return f"{b / 2**30:.0f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"

    fig = slide_figure(600, 420)
    ax = fig.subplots()
    side = 3.2
    blank(ax, (0, 6.0), (0, 4.2))
    ax.set_aspect("equal")
    ax.add_patch(Rectangle((0.2, 0.35), side, side, facecolor="#f5d5d0", edgecolor=C_MAX,
                           lw=2, hatch="//"))
    ax.text(0.2 + side / 2, 0.35 + side / 2, f"P: N × N\n{size(t['p_bytes'])}",
            fontsize=TITLE_PT, weight="bold", ha="center", va="center", color=C_MAX,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 4})
    ax.text(0.2 + side / 2, 0.12, "not kept: recomputed", fontsize=MIN_PT, ha="center",
            va="center", color=C_MAX)
    w_o = max(side * d / N, 0.02)
    ax.add_patch(Rectangle((3.7, 0.35), w_o, side, facecolor=C_OLD, edgecolor=C_OLD, lw=1))
    ax.add_patch(Rectangle((3.85, 0.35), 0.01, side, facecolor=C_SUM, edgecolor=C_SUM, lw=1))
    ax.text(4.0, 3.2, f"O: N × d\n{size(o_bytes)}", fontsize=LABEL_PT, color=C_OLD,
            va="center")
    ax.text(4.0, 2.35, f"lse: N\n{size(t['lse_bytes'])}", fontsize=LABEL_PT, color=C_SUM,
            va="center")
    ax.text(4.0, 1.25, "kept for\nthe backward", fontsize=LABEL_PT, weight="bold", va="center")
    ax.text(0.2, 3.95, f"one layer: N = {N // 1024}k, {H} heads, d = {d}, fp16",
            fontsize=LABEL_PT, va="center")
    ax.text(4.0, 0.5, f"to scale: N = {N // d}·d;\nthe lines widened to be seen",
            fontsize=MIN_PT, color="0.3", va="center")
    return fig


def traffic():
    """HBM bytes of the backward at N = 4k, D = 64, B = 8, H = 32 (``iomodel.backward``): the
    course's three kernels, Algorithm 4 with the same 128-key blocks, and the floor (every
    input read once, every gradient written once)."""
    from course_lib.iomodel.backward import flash_backward_io, flash_v2_backward_io

    io_v2 = flash_v2_backward_io(4096, 4096, 64, 32, 128, 128, 32, B=8, H=32)
    alg4 = flash_backward_io(4096, 4096, 64, 64, 128, B=8, H=32)
    bars = [("Algorithm 4", alg4["hbm_bytes"], C_MAX, ".1f"),
            ("the course's\nthree kernels", io_v2["hbm_bytes"], C_NEW, ".1f"),
            ("floor", io_v2["compulsory"]["hbm_bytes"], GREY, ".2f")]
    fig = slide_figure(600, 360)
    ax = fig.subplots()
    ys = range(len(bars))[::-1]
    for y, (label, b, color, fmt) in zip(ys, bars):
        ax.barh(y, b / 1e9, color=color, height=0.6)
        ax.text(b / 1e9 + 0.4, y, f"{b / 1e9:{fmt}} GB", va="center", fontsize=LABEL_PT,
                weight="bold")
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.set_xlim(0, alg4["hbm_bytes"] / 1e9 * 1.35)
    ax.set_xlabel("HBM bytes, every re-read counted (GB)")
    style_axes(ax, grid=False)
    ax.tick_params(axis="y", labelsize=LABEL_PT, length=0)
    return fig


def backward_io(d: int = 64, M: int = 98_304, seq_lens=(256, 1024, 4096, 16384)):
    """HBM elements of one head's backward against N: the standard backward (Algorithm 3) and
    FlashAttention's (Algorithm 4) with the paper's blocks for an A100's SRAM."""
    from course_lib.iomodel.backward import theorem5_io

    rows = [theorem5_io(n, d, M) for n in seq_lens]
    fig = slide_figure(560, 400)
    ax = fig.subplots()
    ax.loglog(seq_lens, [r["standard"]["elements"] for r in rows], "s-", color=C_MAX, lw=3,
              ms=9, label="standard: Θ(Nd + N²)")
    ax.loglog(seq_lens, [r["elements"] for r in rows], "o-", color=C_OLD, lw=3, ms=9,
              label="Algorithm 4")
    ax.loglog(seq_lens, [20 * r["n2d2_over_M"] for r in rows], ":", color=C_OLD, lw=3,
              label="20·N²d²/M")
    ax.set_xticks(list(seq_lens), [f"{n // 1024}k" if n >= 1024 else str(n) for n in seq_lens])
    ax.minorticks_off()
    ax.set(xlabel="sequence N", ylabel="HBM elements, one head")
    style_axes(ax)
    legend(ax, loc="upper left")
    return fig


_MEM = {"sdpa-MATH": ("SDPA MATH (keeps P)", C_MAX, "s"),
        "sdpa-FLASH_ATTENTION": ("SDPA FlashAttention-2", C_OLD, "^"),
        "flash_attn_v2": ("course flash_attn_v2", C_NEW, "o")}


def memory():
    """Peak memory of forward + backward above the inputs against N (course_lib/data/
    memory.json, H100): SDPA MATH keeps P and grows as N²; the fused kernels grow as N."""
    from course_lib.bench.common import load_result

    result = load_result("memory")
    if result is None:
        return None
    mib = 2**20
    fig = slide_figure(620, 420)
    ax = fig.subplots()
    for p, (label, color, marker) in _MEM.items():
        pts = [(r["N"], r["results"][p]["peak_bytes"] / mib) for r in result["rows"]
               if r["results"].get(p)]
        if pts:
            ax.plot(*zip(*pts), marker=marker, color=color, lw=3, ms=9, label=label)
    ns = [r["N"] for r in result["rows"]]
    ax.plot(ns, [r["p_bytes"] / mib for r in result["rows"]], ":", color=GREY, lw=3,
            label="one N × N matrix P")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
    ax.minorticks_off()
    ax.set(xlabel="sequence N", ylabel="peak MiB above the inputs")
    style_axes(ax)
    legend(ax, loc="upper left")
    return fig


_SPEED = {"v2-portable": ("course v2", C_NEW, "o", "-"),
          "sdpa-CUDNN_ATTENTION": ("cuDNN", C_HBM, "s", "--"),
          "sdpa-FLASH_ATTENTION": ("FlashAttention-2 (SDPA)", C_OLD, "^", "--")}


def backward_speed(D: int = 128, causal: bool = True):
    """Measured backward TFLOP/s (FLOPs = 2.5 × the forward's) against N (course_lib/data/
    attention_bwd.json, H100, every provider called eagerly)."""
    from course_lib.bench.common import load_result

    result = load_result("attention_bwd")
    if result is None:
        return None
    rows = sorted((r for r in result["rows"] if r["D"] == D and r["causal"] == causal),
                  key=lambda r: r["N"])
    fig = slide_figure(1160, 360)
    ax = fig.subplots()
    for name, (label, color, marker, ls) in _SPEED.items():
        pts = [(r["N"], r["results"].get(name, {}).get("tflops")) for r in rows]
        pts = [(n, t) for n, t in pts if t]
        if pts:
            ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, lw=3, ms=9, label=label)
            ax.text(pts[-1][0] * 1.08, pts[-1][1], f"{pts[-1][1]:.0f}", va="center",
                    fontsize=MIN_PT, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["N"] for r in rows], [f"{r['N'] // 1024}k" for r in rows])
    ax.minorticks_off()
    ax.set(xlabel="sequence N", ylabel="TFLOP/s", ylim=(0, 600),
           xlim=(rows[0]["N"] / 1.2, rows[-1]["N"] * 1.5),
           title=f"backward, D = {D}, {'causal' if causal else 'non-causal'}")
    style_axes(ax)
    legend(ax, loc="lower right")
    return fig


FIGURES = {
    "slides_06_kept": kept,
    "slides_06_formulas": formulas,
    "slides_06_matmuls": matmuls,
    "slides_06_dataflow": dataflow,
    "slides_06_dkdv_loop": dkdv_loop,
    "slides_06_backward_io": backward_io,
    "slides_06_traffic": traffic,
    "slides_06_memory": memory,
    "slides_06_backward_speed": backward_speed,
}
