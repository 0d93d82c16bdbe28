"""Slide figures of deck 04 (FlashAttention v1): the tile walk as a build, traffic against SRAM.

Drawn for slides/04_flash_v1.md at slide size (``slides_style``). The tile walk is the
notebook's stepper (``course_lib.widgets.tile_walk.record_walk``, which runs
``reference.flash_v1_reference`` with an HBM counter), one step per slide; the curves come
from ``course_lib.iomodel.attention`` as in notebooks/06_flash_v1_algorithm.ipynb.
"""
from __future__ import annotations

import math

from course_lib.diagrams.slides_style import (
    C_HBM,
    C_MAX,
    C_NEW,
    C_OLD,
    GREY,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    legend,
    off,
    slide_figure,
    style_axes,
)

WALK = {"N_q": 8, "N_k": 12, "d": 4, "block_m": 4, "block_n": 4, "order": "v1", "causal": True}
"""The small causal problem of the walk: 2 Q blocks, 3 K/V blocks, bottom-right mask."""
WALK_STEPS = (0, 2, 4)
"""The steps the deck shows (0-based): the first; the second K/V block, which loads Q_0 and
O_0 again; the block the causal mask hides entirely, computed anyway."""


def _walk():
    from course_lib.widgets.tile_walk import record_walk

    return record_walk(**WALK)


ELL = {"l": "ℓ"}
"""The counter's names as the slides write them: ℓ, not a letter l that reads as 1 or I."""


def tile_walk_step(t: int):
    """Step ``t`` of v1 on the causal walk problem: the score blocks (done: shaded, now: red,
    masked scores grey), Q, O, K, V blocks (coloured: in SRAM now), and the HBM counter."""
    from matplotlib.patches import Rectangle

    from course_lib.reference import causal_mask

    steps = _walk()
    s = steps[t]
    N_q, N_k, bm, bn = WALK["N_q"], WALK["N_k"], WALK["block_m"], WALK["block_n"]
    fig = slide_figure(1160, 420)
    ax, ax_t = fig.subplots(1, 2, width_ratios=[1.25, 1])

    def rect(x, y, w, h, **kw):
        ax.add_patch(Rectangle((x, y), w, h, **kw))

    ax.set_xlim(-4.7, N_k + 0.3)
    ax.set_ylim(N_q + 0.4, -3.9)
    ax.set_aspect("equal")
    off(ax)
    visible = causal_mask(N_q, N_k).numpy()
    for r in range(N_q):
        for c in range(N_k):
            if not visible[r, c]:
                rect(c, r, 1, 1, color="0.8", lw=0)
    for i, j in s["done"][:-1]:
        rect(j * bn, i * bm, bn, bm, color=C_OLD, alpha=0.25, lw=0)
    (r0, r1), (c0, c1) = s["rows"], s["cols"]
    rect(c0, r0, c1 - c0, r1 - r0, fill=False, ec=C_MAX, lw=4)
    ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"S{s['i']}{s['j']}", ha="center", va="center",
            color=C_MAX, fontsize=TITLE_PT, weight="bold")
    for x in range(0, N_k + 1, bn):
        ax.plot([x, x], [0, N_q], color="k", lw=1.2)
    for y in range(0, N_q + 1, bm):
        ax.plot([0, N_k], [y, y], color="k", lw=1.2)
    for label, x0, color in (("Q", -4.4, "#58d68d"), ("O", -2.3, "#bb8fce")):
        ax.text(x0 + 0.8, -0.4, label, ha="center", fontsize=LABEL_PT, weight="bold")
        for i in range(math.ceil(N_q / bm)):
            on = i == s["i"]
            rect(x0, i * bm, 1.6, bm, color=color if on else "white", ec="k", lw=1)
            ax.text(x0 + 0.8, i * bm + bm / 2, str(i), ha="center", va="center",
                    fontsize=MIN_PT)
    for label, y0, color in (("K", -3.6, "#f5b041"), ("V", -1.9, "#f1948a")):
        ax.text(-0.4, y0 + 0.75, label, ha="right", va="center", fontsize=LABEL_PT,
                weight="bold")
        for j in range(math.ceil(N_k / bn)):
            on = j == s["j"]
            rect(j * bn, y0, bn, 1.5, color=color if on else "white", ec="k", lw=1)
            ax.text(j * bn + bn / 2, y0 + 0.75, str(j), ha="center", va="center",
                    fontsize=MIN_PT)

    off(ax_t)
    hbm = s["hbm"]
    reads = hbm["reads"]
    lines = [f"step {t + 1} of {len(steps)}: (i, j) = ({s['i']}, {s['j']})",
             "outer loop j: K/V blocks", "inner loop i: Q blocks", "",
             "HBM so far, elements:",
             "  read  " + ", ".join(f"{k} {n}" for k, n in reads.items() if k in "QKVO"),
             "  read  " + ", ".join(f"{ELL.get(k, k)} {n}" for k, n in reads.items()
                                    if k not in "QKVO"),
             "  written " + ", ".join(f"{ELL.get(k, k)} {n}" for k, n in hbm["writes"].items())]
    ax_t.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=LABEL_PT, linespacing=1.45,
              transform=ax_t.transAxes)
    ax_t.text(0, 0.02, "coloured: in SRAM now\npale blue: score blocks done\n"
              "grey: hidden by the causal mask",
              va="bottom", ha="left", fontsize=MIN_PT, color="0.35", transform=ax_t.transAxes)
    return fig


def v1_at_one_block(N: int = 1024, d: int = 64) -> dict:
    """v1's traffic where one block holds every key (T_c = 1) against the floor: O, ℓ, m are
    still initialised in HBM, read back and written again, so it does not meet the floor."""
    from course_lib.iomodel.attention import compulsory_io, flash_attention_io

    M = 4 * d * N           # B_c = ⌈M / 4d⌉ = N: one K/V block
    v1 = flash_attention_io(N, d, M)
    floor = compulsory_io(N, N, d)["elements"]
    return {"M": M, "T_c": math.ceil(N / v1["block_n"]), "elements": v1["elements"],
            "floor": floor, "ratio": v1["elements"] / floor}


def io_vs_M(N: int = 1024, d: int = 64):
    """HBM elements of one head against the SRAM size M: standard is flat, v1 falls as 1/M and
    levels off above the floor once one block holds every key."""
    from course_lib.iomodel.attention import (
        A100_M,
        compulsory_io,
        flash_attention_io,
        standard_attention_io,
    )

    Ms = [2 ** k for k in range(10, 19)]
    std = standard_attention_io(N, N, d)["elements"]
    v1 = [flash_attention_io(N, d, m)["elements"] for m in Ms]
    floor = compulsory_io(N, N, d)["elements"]
    one = v1_at_one_block(N, d)
    fig = slide_figure(1160, 400)
    ax = fig.subplots()
    ax.loglog(Ms, [std] * len(Ms), color=C_MAX, lw=3, label="standard: no M in it")
    ax.loglog(Ms, v1, "o-", color=C_OLD, lw=3, ms=7, label="FlashAttention v1")
    ax.loglog(Ms, [12 * N * N * d * d / m for m in Ms], "--", color=C_OLD, lw=2, alpha=0.6,
              label="12·N²d²/M")
    ax.loglog(Ms, [floor] * len(Ms), ":", color=GREY, lw=3, label="floor: Q, K, V, O once")
    ax.axvline(A100_M, color="0.3", lw=1.5, ls="-.")
    ax.text(A100_M / 1.1, floor / 1.6, "one A100 SM (192 KiB)", fontsize=MIN_PT, va="center",
            ha="right")
    ax.annotate(f"T_c = 1: {one['ratio']:.1f}× the floor\n(O, ℓ, m still go to HBM)",
                (one["M"], one["elements"]), xytext=(-420, 10), textcoords="offset points",
                fontsize=MIN_PT, arrowprops={"arrowstyle": "-|>", "color": "0.3", "lw": 1.5})
    ax.set(xlabel=f"SRAM size M (elements; N = {N}, d = {d})", ylabel="HBM elements, one head",
           ylim=(floor / 2.5, max(v1) * 1.6))
    style_axes(ax)
    legend(ax, loc="lower left", frameon=True, framealpha=1, edgecolor="white")
    return fig


def block_size_sweep(block_sizes=(64, 128, 256, 512), bandwidth_tbs=1.555, peak_tflops=312.0):
    """The paper's Figure 2 (middle) modelled: v1's HBM bytes (bars) and the roofline's time
    floor on an A100 40GB (line) against the block size B_c, at the Figure 2 shape."""
    from course_lib.iomodel.attention import FIGURE2_SHAPE, flash_v1_io

    sh = FIGURE2_SHAPE
    B, H, N, d, nb = sh["B"], sh["H"], sh["N"], sh["d"], sh["bytes_per_el"]
    rows = [flash_v1_io(N, N, d, min(bs, d), bs, B, H, nb) for bs in block_sizes]
    gb = [r["hbm_bytes"] / 1e9 for r in rows]
    ms = [1e3 * max(r["hbm_bytes"] / (bandwidth_tbs * 1e12), r["flops"] / (peak_tflops * 1e12))
          for r in rows]
    fig = slide_figure(560, 400)
    ax = fig.subplots()
    x = list(range(len(block_sizes)))
    ax.bar(x, gb, color=C_HBM, alpha=0.75)
    for xi, g in zip(x, gb):
        ax.text(xi, g / 2, f"{g:.2f}", ha="center", va="center", fontsize=MIN_PT, color="white",
                weight="bold")
    ax.set_xticks(x, [str(b) for b in block_sizes])
    ax.set(xlabel="block size B_c", ylabel="GB moved (bars)", ylim=(0, max(gb) * 1.2))
    style_axes(ax, grid=False)
    ax2 = ax.twinx()
    ax2.plot(x, ms, "o-", color=C_NEW, lw=3, ms=9)
    compute_ms = rows[0]["flops"] / (peak_tflops * 1e12) * 1e3
    ax2.axhline(compute_ms, color=C_NEW, ls=":", lw=2)
    ax2.text(0.98, 0.97, "dotted: FLOPs / peak", color=C_NEW, fontsize=MIN_PT, ha="right",
             va="top", transform=ax2.transAxes)
    ax2.set_ylabel("time floor, ms (line)", color=C_NEW, fontsize=LABEL_PT)
    ax2.tick_params(labelsize=MIN_PT)
    ax2.set_ylim(0, max(ms) * 1.2)
    ax2.spines["top"].set_visible(False)
    return fig


def pitfalls():
    """What each pitfall of a first block loop costs alone (``sketch_pitfalls.departures``:
    fp64, causal, dropout, N_q > N_k): the largest error of the output against the reference."""
    from course_lib.sketch_pitfalls import ROUNDING, departures

    errs = departures()
    names = [k for k in errs if k.startswith("all fixed but")]
    fig = slide_figure(560, 380)
    ax = fig.subplots()
    y = list(range(len(names)))
    vals = [errs[k] for k in names]
    ax.barh(y, vals, color=C_MAX, height=0.6)
    for yi, v in zip(y, vals):
        ax.text(v + 0.04, yi, f"{v:.2f}", va="center", fontsize=MIN_PT)
    ax.set_yticks(y, [k.replace("all fixed but ", "only ") for k in names])
    ax.invert_yaxis()
    fixed = errs["all fixed"]
    ax.set(xlabel="max |O − reference|", xlim=(0, max(vals) * 1.3),
           title="one pitfall left in" + (f"; all fixed: < {ROUNDING:.0e}"
                                          if fixed < ROUNDING else ""))
    ax.title.set_fontsize(MIN_PT)
    style_axes(ax, grid=False)
    ax.title.set_fontsize(MIN_PT)
    return fig


FIGURES = {
    "slides_04_pitfalls": pitfalls,
    **{f"slides_04_tile_walk_{k + 1}": (lambda t=t: tile_walk_step(t))
       for k, t in enumerate(WALK_STEPS)},
    "slides_04_io_vs_M": io_vs_M,
    "slides_04_block_size_sweep": block_size_sweep,
}
