"""Slide figures of deck 05 (FlashAttention in Triton): block kinds, launch orders, speed, shared
memory, ceiling.

Drawn for slides/05_triton_flash.md at slide size (``slides_style``) from the same code and data
as notebooks/08_triton_flash_v2.ipynb and notebooks/09_hopper.ipynb:
``analysis.flash_v2.causal_block_kinds`` (which key blocks a Q block skips, runs unmasked,
or masks), ``analysis.flash_v2.kv_reuse`` with the DRAM bytes Nsight Compute measured for each
launch order (``analysis.flash_v2.hbm_measurement_1``, course_lib/data/hbm.json), the stored
H100 sweep course_lib/data/attention_fwd.json,
``analysis.hopper.config_rows`` (shared memory of each Hopper config) and
``analysis.hopper.score_costs`` (tensor-core time and softmax time per score element).
FlashAttention-3's timelines and the pinned max's chain are drawn by
``course_lib.diagrams.fa3_timelines`` (``slides_fa3_*``, ``slides_pinned_max_chain``).
"""
from __future__ import annotations

import numpy as np

from course_lib.diagrams.slides_style import (
    C_HBM,
    C_MAX,
    C_NEW,
    C_OLD,
    C_SRAM,
    C_SUM,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    legend,
    off,
    slide_figure,
    style_axes,
)


def causal_kinds(N_q: int = 1000, N_k: int = 1000, BLOCK_M: int = 128, BLOCK_N: int = 64):
    """The (Q block, key block) grid of a causal problem coloured by kind: skipped, unmasked,
    masked; the black line is the last key each query row sees. Drawn to fill most of a slide,
    the block counts in a legend under the grid."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from course_lib.analysis.flash_v2 import KIND_COLORS, KINDS, causal_block_kinds, kind_counts

    kinds = causal_block_kinds(N_q, N_k, BLOCK_M, BLOCK_N, True)
    T_r, T_c = kinds.shape
    fig = slide_figure(780, 500)
    ax = fig.subplots()
    ax.imshow(kinds, cmap=ListedColormap(KIND_COLORS), vmin=0, vmax=2, aspect="auto",
              extent=(0, T_c, T_r, 0), interpolation="nearest")
    for x in range(1, T_c):
        ax.axvline(x, color="white", lw=2.5)
    for y in range(1, T_r):
        ax.axhline(y, color="white", lw=2.5)
    rows = np.linspace(0, N_q, 400)
    ax.plot(np.clip(rows + (N_k - N_q) + 1, 0, N_k) / BLOCK_N, rows / BLOCK_M, color="k",
            lw=3)
    ax.set_xticks(np.arange(0, T_c, 2) + 0.5, [str(j) for j in range(0, T_c, 2)])
    ax.set_yticks(np.arange(T_r) + 0.5, [str(i) for i in range(T_r)])
    ax.set(xlabel=f"key block j (BLOCK_N = {BLOCK_N} keys)",
           ylabel=f"Q block i ({BLOCK_M} rows)", xlim=(0, T_c), ylim=(T_r, 0))
    style_axes(ax, grid=False)
    ax.tick_params(labelsize=LABEL_PT, length=0)
    c = kind_counts(kinds)
    ax.legend(handles=[Patch(color=KIND_COLORS[i], label=f"{KINDS[i]}: {c[KINDS[i]]}")
                       for i in (1, 2, 0)], fontsize=LABEL_PT, loc="upper center",
              bbox_to_anchor=(0.5, -0.16), ncols=3, frameon=False,
              title=f"blocks of a causal N = {N_q}", title_fontsize=LABEL_PT)
    return fig


_PROVIDERS = {"v2-hopper": ("course v2 (Hopper)", C_MAX, "D", "-"),
              "v2-portable": ("course v2 (portable)", C_NEW, "o", "-"),
              "sdpa-CUDNN_ATTENTION": ("cuDNN", C_HBM, "s", "--"),
              "sdpa-FLASH_ATTENTION": ("FlashAttention-2 (SDPA)", C_OLD, "^", "--"),
              "v1": ("course v1", "0.5", "x", ":")}


def forward_speed(causal: bool = False):
    """Measured forward TFLOP/s against N at D = 64 and D = 128 (course_lib/data/
    attention_fwd.json: H100, every provider called eagerly, interleaved rounds)."""
    from course_lib.bench.common import load_result

    result = load_result("attention_fwd")
    if result is None:
        return None
    fig = slide_figure(1160, 360)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, D in zip(axes, (64, 128)):
        rows = sorted((r for r in result["rows"] if r["D"] == D and r["causal"] == causal),
                      key=lambda r: r["N"])
        for name, (label, color, marker, ls) in _PROVIDERS.items():
            pts = [(r["N"], r["results"].get(name, {}).get("tflops")) for r in rows]
            pts = [(n, t) for n, t in pts if t]
            if pts:
                ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, lw=3, ms=8, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["N"] for r in rows], [f"{r['N'] // 1024}k" for r in rows])
        ax.minorticks_off()
        ax.set(title=f"D = {D}, {'causal' if causal else 'non-causal'}", xlabel="sequence N",
               ylim=(0, 650))
        style_axes(ax)
    axes[0].set_ylabel("TFLOP/s")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center",
               fontsize=MIN_PT, frameon=False)
    return fig


def launch_order(BLOCK_M: int = 128, cells: int = 18):
    """The two launch orders of v2's grid at the Figure 2 shape (B 64, H 16, N 1024, d 64,
    fp16), one row each: the first programs in launch order coloured by head (head 0's Q blocks
    orange), the K/V that other heads read between two readers of head 0's K/V (``kv_reuse``)
    against the H100's L2, and the DRAM bytes Nsight Compute measured with each order (the
    heads-fastest grid was the kernel's first: ``hbm_measurement_1``; the Q-blocks-fastest grid
    is today's: data/hbm.json)."""
    from matplotlib.patches import Rectangle

    from course_lib.analysis.flash_v2 import hbm_measurement_1, kv_reuse
    from course_lib.bench.common import load_result
    from course_lib.hardware import get_gpu
    from course_lib.iomodel.attention import FIGURE2_SHAPE, figure2_prediction

    hbm = load_result("hbm")
    if hbm is None:
        return None
    sh = FIGURE2_SHAPE
    B, H, N, d = sh["B"], sh["H"], sh["N"], sh["d"]
    n_m = -(-N // BLOCK_M)
    l2 = get_gpu("H100-SXM").l2_mib
    head_kv_mib = 2 * N * d * sh["bytes_per_el"] / 2**20
    minimum = figure2_prediction(v1_blocks=(64, 64), v2_blocks=(BLOCK_M, 64))["flash_v2_min"]
    first = next(r["gb"] for r in hbm_measurement_1() if r["target"].startswith("v2 portable"))
    today = next(r["total_gb"] for r in hbm["rows"] if r["target"] == "v2-portable")
    orders = (
        ("heads fastest", "grid (B·H, N/BLOCK_M)", "heads_fastest", first),
        ("Q blocks fastest", "grid (N/BLOCK_M, B·H)", "q_blocks_fastest", today))
    head_colors = ("#4c9be8", "#9ccaf3", "#2e6fb0", "#bcd9f5")
    fig = slide_figure(1160, 340)
    axes = fig.subplots(2, 1)
    cw, x0, l2_x, l2_w = 0.5, 5.7, 15.4, 1.0   # cell width; strip start; L2 box; its width
    for ax, (name, grid_text, order, measured) in zip(axes, orders):
        off(ax)
        ax.set_xlim(0, 24.2)
        ax.set_ylim(0.25, 2.75)
        r = kv_reuse(B, H, H, N, N, d, BLOCK_M, order=order)
        ax.text(0, 1.4, name, fontsize=TITLE_PT, weight="bold", va="bottom")
        ax.text(0, 1.25, grid_text, fontsize=MIN_PT, va="top", color="0.3")
        # the launch strip: program i's head, for the first and the second round of head 0
        if order == "heads_fastest":
            heads = list(range(8)) + [None] + [B * H - 2, B * H - 1] + list(range(cells - 11))
        else:
            heads = [0] * n_m + [1] * n_m + [None] + [2]
        heads = heads[:cells]
        ys, h = 0.9, 0.8
        for i, head in enumerate(heads):
            x = x0 + i * cw
            if head is None:
                ax.text(x + cw / 2, ys + h / 2, "…", ha="center", va="center",
                        fontsize=LABEL_PT)
                continue
            color = C_NEW if head == 0 else head_colors[head % len(head_colors)]
            ax.add_patch(Rectangle((x, ys), cw, h, facecolor=color, edgecolor="white", lw=2))
        ax.text(x0, ys - 0.12, "launch order →   orange: head 0", fontsize=MIN_PT, va="top",
                color="0.3")
        zeros = [i for i, head in enumerate(heads) if head == 0]
        if order == "heads_fastest":
            a, b = (x0 + zeros[0] * cw + cw / 2, x0 + zeros[1] * cw + cw / 2)
            ax.annotate("", xy=(b, ys + h + 0.05), xytext=(a, ys + h + 0.05),
                        arrowprops={"arrowstyle": "->", "color": C_NEW, "lw": 2.5,
                                    "connectionstyle": "arc3,rad=-0.25"})
            ax.text((a + b) / 2, ys + h + 0.75, f"head 0 again after "
                    f"{r['programs_between']} other programs", ha="center", va="bottom",
                    fontsize=MIN_PT, color=C_NEW)
        else:
            a, b = x0 + zeros[0] * cw, x0 + (zeros[-1] + 1) * cw
            ax.plot([a, a, b, b], [ys + h + 0.1, ys + h + 0.25, ys + h + 0.25, ys + h + 0.1],
                    color=C_NEW, lw=2.5)
            ax.text((a + b) / 2, ys + h + 0.35, f"head 0's {n_m} Q blocks, side by side",
                    ha="center", va="bottom", fontsize=MIN_PT, color=C_NEW)
        # the L2: other K/V read between two readers of head 0's K/V, against its size
        other = r["kv_bytes_between"] / 2**20
        ax.add_patch(Rectangle((l2_x, ys), l2_w, h, facecolor="none", edgecolor=C_SRAM,
                               lw=3, zorder=3))
        ax.text(l2_x + l2_w / 2, ys - 0.12, f"L2 {l2:g} MiB", ha="center", va="top",
                fontsize=MIN_PT, color=C_SRAM)
        width = max(other / l2 * l2_w, 0.12)
        ax.add_patch(Rectangle((l2_x, ys + 0.15), width, h - 0.3,
                               facecolor=C_HBM if other > l2 else C_SUM, edgecolor="none",
                               zorder=4))
        if other > l2:
            text = f"{other:.0f} MiB of other K/V in between: evicted"
        else:
            text = f"nothing in between: head 0's {head_kv_mib * 1024:.0f} KiB of K/V stay"
        ax.text(l2_x, ys + h + 0.2, text, fontsize=MIN_PT, va="bottom")
        ax.text(24.2, ys + h / 2, f"{measured:.3f} GB", ha="right", va="center",
                fontsize=TITLE_PT, weight="bold", color=C_HBM if other > l2 else C_SUM)
        ax.text(24.2, ys - 0.12, f"DRAM, {measured * 1e9 / minimum:.3g}× the minimum",
                ha="right", va="top", fontsize=MIN_PT, color="0.3")
    return fig


def smem_per_program(D: int = 128):
    """Shared memory of five Hopper configs at head dim D: the Q tile (when Q is not held in
    registers) and K + V tiles per pipeline stage (numbered), against one block's limit; a
    legend names the parts."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from course_lib.analysis.hopper import config_rows

    want = ("128x128 w8 s3 Q smem", "128x128 w8 s3", "128x128 w8 s2", "128x64 w4 s3",
            "64x64 w4 s3")
    rows = {r["config"]: r for r in config_rows(head_dims=(D,))}
    rows = [rows[c] for c in want if c in rows]
    q_color, stage_colors = "#8e44ad", (C_OLD, "#85c1e9")
    fig = slide_figure(560, 410)
    ax = fig.subplots()
    for x, r in enumerate(rows):
        ax.bar(x, r["q_kib"], color=q_color, edgecolor="white")
        for s in range(r["stages"]):
            bottom = r["q_kib"] + s * r["per_stage_kib"]
            ax.bar(x, r["per_stage_kib"], bottom=bottom, color=stage_colors[s % 2],
                   edgecolor="white")
            ax.text(x, bottom + r["per_stage_kib"] / 2, f"{s + 1}", ha="center", va="center",
                    fontsize=MIN_PT, color="white" if s % 2 == 0 else "black")
        ax.text(x, r["total_kib"] + 4, f"{r['total_kib']:.0f}", ha="center", fontsize=MIN_PT)
    budget = rows[0]["budget_kib"]
    ax.axhline(budget, color=C_MAX, ls="--", lw=2.5)
    labels = [r["config"].split(" w")[0] + f"\n{r['stages']} st."
              + ("\n+Q" if r["q_kib"] else "") for r in rows]
    ax.set_xticks(range(len(rows)), labels)
    ax.set(ylabel=f"KiB per program, D = {D}", ylim=(0, budget * 1.5),
           yticks=range(0, int(budget) + 1, 50))
    style_axes(ax, grid=False)
    ax.legend(handles=[Patch(color=q_color),
                       (Patch(color=stage_colors[0]), Patch(color=stage_colors[1])),
                       Line2D([], [], color=C_MAX, ls="--", lw=2.5)],
              labels=["Q tile (Q in shared memory)", "K + V tiles of one stage (numbered)",
                      f"{budget:.0f} KiB: one program's limit"],
              handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, fontsize=MIN_PT,
              loc="upper right", frameon=False, borderaxespad=0.1)
    return fig


def ceiling(measured_N: int = 16384):
    """Left: per score element, tensor-core time (4·D FLOPs) against softmax time (one exp2 and
    a few FP32 operations), at D = 64 and 128. Right: the ceiling of running the two one after
    the other, with the measured forward speed (non-causal, N = 16k)."""
    from course_lib.analysis.hopper import score_costs
    from course_lib.bench.common import load_result

    dims = (64, 128)
    costs = [score_costs(d) for d in dims]
    fwd = load_result("attention_fwd")
    fig = slide_figure(1160, 380)
    ax1, ax2 = fig.subplots(1, 2)
    x = np.arange(len(dims))
    ax1.bar(x - 0.2, [c["mma_ps"] for c in costs], 0.4, color="#3a923a", label="tensor cores")
    ax1.bar(x + 0.2, [c["exp2_ps"] for c in costs], 0.4, color=C_MAX, label="exp2")
    ax1.bar(x + 0.2, [c["fp32_ps"] for c in costs], 0.4, bottom=[c["exp2_ps"] for c in costs],
            color=C_NEW, label="other FP32 work")
    ax1.set_xticks(x, [f"D = {d}" for d in dims])
    ax1.set(ylabel="ps per score element", title="the two numbers")
    style_axes(ax1, grid=False)
    legend(ax1, loc="upper left")
    ax1.set_ylim(0, max(c["mma_ps"] for c in costs) * 1.5)
    serial = [c["serial_tflops"] for c in costs]
    ax2.bar(x - 0.2, serial, 0.4, color="0.7", label="ceiling, one after the other")
    if fwd is not None:
        meas = [next(r["results"]["v2-hopper"]["tflops"] for r in fwd["rows"]
                     if (r["D"], r["causal"], r["N"]) == (d, False, measured_N)) for d in dims]
        ax2.bar(x + 0.2, meas, 0.4, color=C_SUM, label="measured, course v2")
        for xi, m in zip(x, meas):
            ax2.text(xi + 0.2, m + 12, f"{m:.0f}", ha="center", fontsize=MIN_PT)
    for xi, s in zip(x, serial):
        ax2.text(xi - 0.2, s + 12, f"{s:.0f}", ha="center", fontsize=MIN_PT)
    ax2.set_xticks(x, [f"D = {d}" for d in dims])
    ax2.set(ylabel="TFLOP/s", title=f"model against measured (N = {measured_N // 1024}k)",
            ylim=(0, 800))
    style_axes(ax2, grid=False)
    legend(ax2, loc="upper left")
    return fig


FIGURES = {
    "slides_05_causal_kinds": causal_kinds,
    "slides_05_launch_order": launch_order,
    "slides_05_forward_speed": forward_speed,
    "slides_05_smem": smem_per_program,
    "slides_05_ceiling": ceiling,
}
