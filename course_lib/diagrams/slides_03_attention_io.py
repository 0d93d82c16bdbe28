"""Slide figures of deck 03 (attention's IO): traffic against N, and the measured DRAM bytes.

Drawn for slides/03_attention_io.md (the measured bytes also for decks 04 and 05) at slide size
(``slides_style``) from ``course_lib.iomodel.attention`` (the closed forms and the instrumented
loops of notebooks/04_attention_io.ipynb) and from the Nsight Compute measurement stored in
course_lib/data/hbm.json.
"""
from __future__ import annotations

from course_lib.diagrams.slides_style import (
    C_HBM,
    C_MAX,
    C_OLD,
    GREY,
    LABEL_PT,
    MIN_PT,
    legend,
    slide_figure,
    style_axes,
)


def io_vs_N(d: int = 64, count_up_to: int = 2048):
    """HBM elements of one head against N: standard attention, FlashAttention v1 with the
    paper's blocks for an A100's SRAM, and the floor; circles: counted by the loops."""
    from course_lib.iomodel.attention import (
        A100_M,
        compulsory_io,
        count_flash_v1,
        count_standard,
        flash_v1_io,
        paper_block_sizes,
        standard_attention_io,
    )

    Ns = [2 ** k for k in range(7, 17)]
    B_r, B_c = paper_block_sizes(A100_M, d)
    std = [standard_attention_io(n, n, d)["elements"] for n in Ns]
    v1 = [flash_v1_io(n, n, d, B_r, B_c)["elements"] for n in Ns]
    floor = [compulsory_io(n, n, d)["elements"] for n in Ns]
    fig = slide_figure(1160, 400)
    ax = fig.subplots()
    ax.loglog(Ns, std, color=C_MAX, lw=3, label="standard: 4Nd + 4N²")
    ax.loglog(Ns, v1, color=C_OLD, lw=3, label="FlashAttention v1 (deck 04)")
    ax.loglog(Ns, floor, ":", color=GREY, lw=3, label="floor: Q, K, V, O once")
    small = [n for n in Ns if n <= count_up_to]
    ax.loglog(small, [count_standard(n, n, d).elements for n in small], "o", color=C_MAX,
              mfc="none", ms=11, mew=2)
    ax.loglog(small, [count_flash_v1(n, n, d, B_r, B_c).elements for n in small], "o",
              color=C_OLD, mfc="none", ms=11, mew=2, label="counted by running the loops")
    ax.annotate("", xy=(Ns[-1], v1[-1]), xytext=(Ns[-1], std[-1]),
                arrowprops={"arrowstyle": "<->", "color": "k", "lw": 2})
    ax.text(Ns[-1] * 1.1, (v1[-1] * std[-1]) ** 0.5, f"{std[-1] / v1[-1]:.1f}×\nfewer",
            ha="left", va="center", fontsize=LABEL_PT)
    ax.set_xlim(100, Ns[-1] * 2.6)
    ticks = [128, 1024, 8192, 65536]
    ax.set_xticks(ticks, ["128", "1k", "8k", "64k"])
    ax.minorticks_off()
    ax.set(xlabel=f"sequence length N (d = {d})", ylabel="HBM elements, one head")
    style_axes(ax)
    legend(ax, loc="upper left")
    return fig


def hbm_measured(highlight: str | None = None):
    """DRAM bytes (read + written, Nsight Compute) of each implementation at the FlashAttention
    paper's Figure 2 shape, on a log axis, with the IO model's prediction and the minimum."""
    from course_lib.bench.common import load_result

    result = load_result("hbm")
    if result is None:
        return None
    names = {"sdpa-MATH": "SDPA MATH (standard)", "v1": "course v1",
             "sdpa-FLASH_ATTENTION": "SDPA FlashAttention-2", "sdpa-CUDNN_ATTENTION": "cuDNN",
             "v2-portable": "course v2", "v2-hopper": "course v2, Hopper"}
    rows = [r for r in result["rows"] if r.get("total_gb") and r["target"] in names]
    fig = slide_figure(1160, 330)
    ax = fig.subplots()
    y = list(range(len(rows)))[::-1]
    colors = [C_MAX if r["target"] in ("sdpa-MATH", "v1") else C_OLD for r in rows]
    ax.barh(y, [r["total_gb"] for r in rows], color=colors, height=0.62)
    for yi, r in zip(y, rows):
        ax.text(r["total_gb"] * 1.08, yi, f"{r['total_gb']:.3g} GB", va="center",
                fontsize=MIN_PT)
        if r.get("predicted_gb") and r["predicted_gb"] != result["minimum_gb"]:
            ax.plot([r["predicted_gb"]] * 2, [yi - 0.4, yi + 0.4], color="black", lw=3)
    ax.axvline(result["minimum_gb"], color=C_HBM, ls="--", lw=2)
    ax.text(result["minimum_gb"] * 1.05, -0.95, f"floor {result['minimum_gb']:.3f} GB",
            ha="left", va="center", fontsize=MIN_PT, color=C_HBM)
    ax.set_ylim(-1.4, len(rows) - 0.5)
    ax.set_yticks(y, [names[r["target"]] for r in rows], fontsize=LABEL_PT)
    ax.set_xscale("log")
    ax.set_xlim(0.25, 150)
    ax.set_xlabel("GB read + written in DRAM (black: the IO model's prediction)")
    style_axes(ax)
    ax.tick_params(axis="y", labelsize=LABEL_PT)
    ax.grid(False, axis="y")
    return fig


def standard_attention():
    """The three kernels of standard attention and their 8 HBM operations (the notebook's
    ``diagrams.standard_attention`` figure, its texts enlarged for the room)."""
    from course_lib.diagrams.slides_style import enlarged
    from course_lib.diagrams.standard_attention import standard_attention_figure

    return enlarged(standard_attention_figure(), factor=1.25, min_pt=15)


FIGURES = {
    "slides_03_standard_attention": standard_attention,
    "slides_03_io_vs_N": io_vs_N,
    "slides_03_hbm_measured": hbm_measured,
}
