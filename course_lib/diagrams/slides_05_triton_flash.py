"""Slide figures of deck 05 (FlashAttention in Triton): block kinds, speed, shared memory, ceiling.

Drawn for slides/05_triton_flash.md at slide size (``slides_style``) from the same code and data
as notebooks/08_triton_flash_v2.ipynb and notebooks/09_hopper.ipynb:
``analysis.flash_v2.causal_block_kinds`` (which key blocks a Q block skips, runs unmasked,
or masks), the stored H100 sweep course_lib/data/attention_fwd.json,
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
    C_SUM,
    MIN_PT,
    legend,
    slide_figure,
    style_axes,
)


def causal_kinds(N_q: int = 1000, N_k: int = 1000, BLOCK_M: int = 128, BLOCK_N: int = 64):
    """The (Q block, key block) grid of a causal problem coloured by kind: skipped, unmasked,
    masked; the black line is the last key each query row sees."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from course_lib.analysis.flash_v2 import KIND_COLORS, KINDS, causal_block_kinds, kind_counts

    kinds = causal_block_kinds(N_q, N_k, BLOCK_M, BLOCK_N, True)
    T_r, T_c = kinds.shape
    fig = slide_figure(660, 400)
    ax = fig.subplots()
    ax.imshow(kinds, cmap=ListedColormap(KIND_COLORS), vmin=0, vmax=2, aspect="equal",
              extent=(0, T_c, T_r, 0), interpolation="nearest")
    ax.set_xticks(np.arange(T_c + 1), minor=True)
    ax.set_yticks(np.arange(T_r + 1), minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    rows = np.linspace(0, N_q, 400)
    ax.plot(np.clip(rows + (N_k - N_q) + 1, 0, N_k) / BLOCK_N, rows / BLOCK_M, color="k",
            lw=2)
    ax.set_xticks(range(0, T_c, 4))
    ax.set_yticks(range(0, T_r, 2))
    ax.set(xlabel=f"key block (BLOCK_N = {BLOCK_N})", ylabel=f"Q block ({BLOCK_M} rows)")
    style_axes(ax, grid=False)
    ax.grid(which="minor", color="white", lw=1.5)
    c = kind_counts(kinds)
    ax.legend(handles=[Patch(color=KIND_COLORS[i], label=f"{KINDS[i]}: {c[KINDS[i]]}")
                       for i in (1, 2, 0)], fontsize=MIN_PT, loc="upper left",
              bbox_to_anchor=(1.02, 1), frameon=False, title=f"N = {N_q}",
              title_fontsize=MIN_PT)
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


def smem_per_program(D: int = 128):
    """Shared memory of five Hopper configs at head dim D: the Q tile (when Q is not held in
    registers) and K + V tiles per pipeline stage, against one block's limit."""
    from course_lib.analysis.hopper import config_rows

    want = ("128x128 w8 s3 Q smem", "128x128 w8 s3", "128x128 w8 s2", "128x64 w4 s3",
            "64x64 w4 s3")
    rows = {r["config"]: r for r in config_rows(head_dims=(D,))}
    rows = [rows[c] for c in want if c in rows]
    fig = slide_figure(560, 420)
    ax = fig.subplots()
    for x, r in enumerate(rows):
        ax.bar(x, r["q_kib"], color="#8e44ad", edgecolor="white")
        for s in range(r["stages"]):
            ax.bar(x, r["per_stage_kib"], bottom=r["q_kib"] + s * r["per_stage_kib"],
                   color=(C_OLD, "#85c1e9")[s % 2], edgecolor="white")
        ax.text(x, r["total_kib"] + 4, f"{r['total_kib']:.0f}", ha="center", fontsize=MIN_PT)
    budget = rows[0]["budget_kib"]
    ax.axhline(budget, color=C_MAX, ls="--", lw=2.5)
    ax.text(len(rows) - 0.5, budget + 6, f"{budget:.0f} KiB per block", color=C_MAX,
            fontsize=MIN_PT, ha="right")
    labels = [r["config"].split(" w")[0] + f"\n{r['stages']} st."
              + ("\n+Q" if r["q_kib"] else "") for r in rows]
    ax.set_xticks(range(len(rows)), labels)
    ax.set(ylabel=f"KiB per program, D = {D}", ylim=(0, budget * 1.18))
    style_axes(ax, grid=False)
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
    "slides_05_forward_speed": forward_speed,
    "slides_05_smem": smem_per_program,
    "slides_05_ceiling": ceiling,
}
