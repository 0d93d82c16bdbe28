"""Slide figures of deck 02 (GPU memory and tiling): the roofline, a tiled matmul step, tiles.

Drawn for slides/02_gpu_tiling.md at slide size (``slides_style``) from the same models as
notebooks/02_gpu_memory.ipynb and notebooks/03_tiled_matmul.ipynb: ``course_lib.roofline`` and
``course_lib.hardware`` for the H100's ceilings, ``course_lib.iomodel`` for the bytes each
operation moves, ``course_lib.widgets.tiled_matmul.schedule`` for the tiled loop.
"""
from __future__ import annotations

import math

import numpy as np

from course_lib.diagrams.slides_style import (
    C_HBM,
    C_NEW,
    C_OLD,
    C_SRAM,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    arrow,
    blank,
    box,
    legend,
    off,
    slide_figure,
    style_axes,
)

ROOFLINE_SHAPE = {"N": 4096, "d": 64, "B": 1, "H": 16}
"""The attention shape of notebook 02's roofline (``roofline.lesson_ops``'s defaults)."""


def roofline_points(gpu: str = "H100-SXM") -> list[tuple[str, float, float]]:
    """(label, FLOPs, HBM bytes) of the operations the slide places: a 4096³ matmul naive and
    with 128² tiles, the softmax and S = QKᵀ kernels of standard attention, and fused attention
    moving only its compulsory bytes (Q, K, V read once, O and lse written once: what the
    course's v2 kernel measures on an H100, L2 serving the re-reads of K and V)."""
    from course_lib.iomodel.attention import compulsory_io, standard_attention_steps
    from course_lib.iomodel.matmul import matmul_compulsory_bytes, matmul_flops, matmul_hbm_bytes

    n = 4096
    s = ROOFLINE_SHAPE
    steps = {st["name"]: st for st in standard_attention_steps(s["N"], s["d"], B=s["B"],
                                                                H=s["H"])}
    soft = next(v for k, v in steps.items() if "softmax" in k)
    qk = next(v for k, v in steps.items() if k.startswith("S"))
    floor = compulsory_io(s["N"], s["N"], s["d"], s["B"], s["H"])
    return [
        ("matmul, naive", matmul_flops(n, n, n), matmul_hbm_bytes(n, n, n, None)),
        ("matmul, 128² tiles", matmul_flops(n, n, n), matmul_hbm_bytes(n, n, n, 128)),
        ("matmul, each matrix once", matmul_flops(n, n, n), matmul_compulsory_bytes(n, n, n)),
        ("softmax of S", soft["flops"], soft["hbm_bytes"]),
        ("S = QKᵀ (writes S)", qk["flops"], qk["hbm_bytes"]),
        ("fused attention,\nQ K V O once", floor["flops"], floor["hbm_bytes"]),
    ]


#: Where each point's label sits: (offset in points, ha, va). Every label touches its point on
#: the side away from the roof line: below-right of a point on the slope, above-left or
#: below-right on the flat roof. The 128² matmul (63 FLOP/B) and S = QKᵀ (62 FLOP/B) share a
#: spot: the matmul is the larger ring around the smaller one, labelled on the other side.
ROOFLINE_LABELS = {
    "matmul, naive": ((10, -8), "left", "top"),
    "matmul, 128² tiles": ((-12, 8), "right", "bottom"),
    "matmul, each matrix once": ((-10, 9), "right", "bottom"),
    "softmax of S": ((10, -8), "left", "top"),
    "S = QKᵀ (writes S)": ((12, -8), "left", "top"),
    "fused attention,\nQ K V O once": ((8, -10), "left", "top"),
}


def roofline(gpu: str = "H100-SXM"):
    """The H100's fp16 roofline with six operations on it, each labelled beside its point."""
    from course_lib.hardware import get_gpu

    g = get_gpu(gpu)
    peak, bw = g.peak_tflops("fp16"), g.hbm_tbs
    ridge = g.ridge_point("fp16")
    fig = slide_figure(1160, 400)
    ax = fig.subplots()
    x = np.logspace(-1, 4.6, 300)
    roof = np.minimum(peak, bw * x)
    ax.loglog(x, roof, color="black", lw=3)
    ax.axvspan(x[0], ridge, color=C_HBM, alpha=0.07)
    ax.plot([ridge, ridge], [0.15, peak], color="0.4", ls=":", lw=1.5)  # up to the corner
    ax.text(ridge * 1.1, 0.55, f"ridge\n{ridge:.0f} FLOP/B", fontsize=MIN_PT, color="0.3")
    ax.text(0.13, 700, "memory-bound", fontsize=LABEL_PT, color=C_HBM, weight="bold")
    ax.text(ridge * 2.2, 2.5, "compute-bound", fontsize=LABEL_PT, color="0.2", weight="bold")
    ax.text(x[-1] * 0.9, peak * 1.25, f"{peak:g} TFLOP/s", fontsize=MIN_PT, ha="right",
            va="bottom")
    ax.text(0.2, bw * 0.2 * 1.9, f"{bw:g} TB/s", fontsize=MIN_PT, rotation=25)
    points = roofline_points(gpu)
    for name, f, b in points:
        i = f / b
        y = min(peak, bw * i)
        color = C_OLD if name.startswith("matmul") else C_NEW
        # a ring around another point's ring: drawn larger and below it
        shared = any(other != name and abs(f2 / b2 / i - 1) < 0.1 for other, f2, b2 in points)
        big = shared and name.startswith("matmul")
        ax.plot([i], [y], "o", color=color, ms=22 if big else 12, mfc="white", mew=3,
                zorder=2 if big else 3)
        label = f"{name}: {i:.3g}" if i < 10 else f"{name}: {i:.0f}"
        offset, ha, va = ROOFLINE_LABELS[name]
        ax.annotate(label, (i, y), xytext=offset, textcoords="offset points", ha=ha, va=va,
                    fontsize=MIN_PT, color=color)
    ax.set(xlabel="arithmetic intensity (FLOP per byte of HBM traffic)",
           ylabel="attainable TFLOP/s", ylim=(0.15, 6000), xlim=(x[0], x[-1]))
    style_axes(ax)
    return fig


def tiled_matmul(m: int = 32, n: int = 32, k: int = 32, tile: int = 16, step: int = 3):
    """Step ``step`` of the 16×16-tiled 32×32 matmul: A, B and C with the two tiles now in
    shared memory, the C tile being accumulated, and grey = times each element came from
    HBM so far."""
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.patches import Rectangle

    from course_lib.widgets.tiled_matmul import schedule

    steps = schedule(m, n, k, tile)
    s = steps[step]
    a_reads, b_reads = np.zeros((m, k), int), np.zeros((k, n), int)
    for t in steps[: step + 1]:
        a_reads[t.i0:t.i1, t.k0:t.k1] += 1
        b_reads[t.k0:t.k1, t.j0:t.j1] += 1
    fig = slide_figure(620, 470)
    ax = fig.subplots()
    gap = 5
    x_c, y_b = k + gap, -(k + gap)
    greys = LinearSegmentedColormap.from_list("reads", ["white", "0.5"])
    vmax = max(1, math.ceil(n / tile))
    for data, x0, y0 in ((a_reads, 0, 0), (b_reads, x_c, y_b)):
        rows, cols = data.shape
        ax.imshow(data, cmap=greys, vmin=0, vmax=vmax, extent=(x0, x0 + cols, y0 + rows, y0),
                  interpolation="nearest", zorder=0)
    c_state = np.zeros((m, n))
    for t in steps[: step + 1]:
        c_state[t.i0:t.i1, t.j0:t.j1] = 1.0 if t.k1 == k else 0.0
    green = LinearSegmentedColormap.from_list("c", ["white", "#b7e4c7"])
    ax.imshow(c_state, cmap=green, vmin=0, vmax=1, extent=(x_c, x_c + n, m, 0),
              interpolation="nearest", zorder=0)
    for x0, y0, rows, cols in ((0, 0, m, k), (x_c, y_b, k, n), (x_c, 0, m, n)):
        for r in range(0, rows + 1, tile):
            ax.plot([x0, x0 + cols], [y0 + r, y0 + r], color="0.2", lw=1.5)
        for c in range(0, cols + 1, tile):
            ax.plot([x0 + c, x0 + c], [y0, y0 + rows], color="0.2", lw=1.5)
    for (x0, y0, w, h), color in (((s.k0, s.i0, s.k1 - s.k0, s.i1 - s.i0), C_OLD),
                                  ((x_c + s.j0, y_b + s.k0, s.j1 - s.j0, s.k1 - s.k0), C_NEW)):
        ax.add_patch(Rectangle((x0, y0), w, h, color=color, alpha=0.45, lw=0, zorder=2))
        ax.add_patch(Rectangle((x0, y0), w, h, fill=False, edgecolor=color, lw=4, zorder=3))
    ax.add_patch(Rectangle((x_c + s.j0, s.i0), s.j1 - s.j0, s.i1 - s.i0, fill=False,
                           edgecolor="#1b4332", lw=4, zorder=3))
    ax.text(k / 2, m + 1.5, "A", ha="center", va="top", fontsize=TITLE_PT, weight="bold")
    ax.text(x_c + n / 2, m + 1.5, "C", ha="center", va="top", fontsize=TITLE_PT, weight="bold")
    ax.text(x_c - 1.5, y_b + k / 2, "B", ha="right", va="center", fontsize=TITLE_PT,
            weight="bold")
    ax.text(0, y_b, f"step {step + 1} of {len(steps)}\n\nHBM reads\nso far: {s.reads_so_far:,}"
            f"\nwhen done: {steps[-1].reads_so_far:,}", ha="left", va="top", fontsize=LABEL_PT)
    ax.set_xlim(-1, x_c + n + 1)
    ax.set_ylim(m + 6, y_b - 1)
    ax.set_aspect("equal")
    off(ax)
    return fig


def tile_sweep(n: int = 4096, gpus=("L4", "A100-80GB", "H100-SXM"), max_tile: int = 512):
    """Global reads of an n³ matmul against the square tile size T, and the largest T whose
    A and B tiles fit each GPU's shared memory per block."""
    from course_lib.hardware import get_gpu
    from course_lib.iomodel.matmul import largest_square_tile, matmul_global_reads

    fig = slide_figure(1160, 400)
    ax = fig.subplots()
    tiles = 2 ** np.arange(0, int(math.log2(max_tile)) + 1)
    reads = np.array([matmul_global_reads(n, n, n, int(t)) for t in tiles], dtype=float)
    ax.loglog(tiles, reads, "o-", color=C_HBM, lw=3, ms=8, label=f"global reads, {n}³ matmul")
    floor = 2 * n * n
    ax.axhline(floor, color="0.4", ls="--", lw=1.5)
    ax.text(1, floor * 1.4, "floor: A and B read once", fontsize=MIN_PT, color="0.3",
            ha="left")  # left: clear of the GPUs' vertical lines
    for idx, name in enumerate(gpus):
        g = get_gpu(name)
        cap = g.smem_per_block_bytes or g.smem_per_sm_bytes
        t_max = largest_square_tile(cap, 2)
        color = (C_SRAM, C_OLD, C_NEW)[idx % 3]
        ax.axvline(t_max, color=color, lw=2.5, ls=("-", "--", "-.")[idx % 3],
                   label=f"{name}: {cap / 1024:g} KiB per block → T ≤ {t_max}")
    ax.set_xticks(tiles, [str(t) for t in tiles])
    ax.minorticks_off()
    ax.set(xlabel="tile size T (fp16 A and B tiles of T × T)",
           ylabel="elements read from HBM", xlim=(0.8, max_tile * 1.2),
           ylim=(floor / 2, reads[0] * 3))
    style_axes(ax)
    legend(ax, loc="lower left", bbox_to_anchor=(0, 0.12))
    return fig


def time_floors(gpu: str = "H100-SXM"):
    """The roofline's time floor of attention (N 4096, d 64, 16 heads, fp16): the three kernels
    of standard attention added up, fused attention with FlashAttention v1's traffic, and
    fused attention moving Q, K, V, O once (``roofline.lesson_ops(fa2=True)``)."""
    from course_lib import roofline as rl

    s = ROOFLINE_SHAPE
    ops = rl.classify(gpu, rl.lesson_ops(gpu, N=s["N"], d=s["d"], B=s["B"], H=s["H"],
                                         fa2=True))
    std = sum(r["time_floor_us"] for r in ops if r["name"].startswith("attention:"))
    rows = [("standard:\nthree kernels", std, C_HBM),
            ("fused,\nv1 traffic", ops[-2]["time_floor_us"], C_OLD),
            ("fused,\nQ K V O once", ops[-1]["time_floor_us"], C_SRAM)]
    fig = slide_figure(520, 330)
    ax = fig.subplots()
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [r[1] for r in rows], color=[r[2] for r in rows], height=0.6)
    for yi, (_, us, _) in zip(y, rows):
        ax.text(us + 10, yi, f"{us:.0f} µs", va="center", fontsize=LABEL_PT)
    ax.set_yticks(y, [r[0] for r in rows])
    ax.set(xlabel="time floor (µs)", xlim=(0, std * 1.35))
    style_axes(ax, grid=False)
    return fig


def program_order(rows: int = 7, cols: int = 6, group_m: int = 3, wave: int = 9):
    """C as rows × cols tiles numbered by the program that computes it: row-major launch order
    against grouped order (GROUP_M rows at a time); the first ``wave`` programs shaded."""
    from matplotlib.patches import Rectangle

    def grouped(pid):
        width = group_m * cols
        first = (pid // width) * group_m
        size = min(rows - first, group_m)
        return first + (pid % width) % size, (pid % width) // size

    fig = slide_figure(560, 360)
    axes = fig.subplots(1, 2)
    for ax, name in zip(axes, ("row-major", f"grouped, GROUP_M = {group_m}")):
        for pid in range(rows * cols):
            r, c = divmod(pid, cols) if name == "row-major" else grouped(pid)
            first = pid < wave
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=C_OLD if first else "white",
                                   edgecolor="0.35", lw=1))
            ax.text(c + 0.5, r + 0.5, str(pid), ha="center", va="center", fontsize=MIN_PT,
                    color="white" if first else "0.25", weight="bold" if first else "normal")
        a_bands = len({(divmod(p, cols)[0] if name == "row-major" else grouped(p)[0])
                       for p in range(wave)})
        b_bands = len({(divmod(p, cols)[1] if name == "row-major" else grouped(p)[1])
                       for p in range(wave)})
        ax.set_title(f"{name}\n{a_bands} + {b_bands} bands", fontsize=MIN_PT)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        off(ax)
    return fig


def gpu(key: str = "H100-SXM"):
    """The chip at slide size: SMs with their registers and shared memory, the L2 they share,
    and the HBM off the chip, with the sizes and the bandwidth of ``course_lib.hardware``
    (``diagrams.memory.hierarchy``, the notebook's figure, drawn for a room)."""
    from course_lib.diagrams.memory import hierarchy
    from course_lib.hardware import get_gpu

    g = get_gpu(key)
    regs, smem, l2, hbm = hierarchy(key)
    fig = slide_figure(1160, 440)
    ax = fig.subplots()
    blank(ax, (0, 11.6), (0, 4.4))
    box(ax, 0.1, 1.45, 11.4, 2.9, "", color="#f2f6fb", edge="#3b5b92")
    ax.text(0.3, 4.05, f"{g.name}: one chip, {g.sms} SMs", fontsize=TITLE_PT, weight="bold",
            color="#1f3b63", va="center")
    for i, (x, name) in enumerate(((0.4, "SM 0"), (3.2, "SM 1"), (7.7, f"SM {g.sms - 1}"))):
        box(ax, x, 2.35, 2.5, 1.45, "", color="white", edge="0.3")
        ax.text(x + 1.25, 3.6, name, fontsize=LABEL_PT, weight="bold", ha="center",
                va="center")
        box(ax, x + 0.12, 2.95, 2.26, 0.45, f"registers {regs['per_sm_kib']:.0f} KiB",
            color="#fde2c2", fontsize=MIN_PT)
        box(ax, x + 0.12, 2.45, 2.26, 0.45, f"shared mem ≤ {smem['per_sm_kib']:.0f} KiB",
            color="#d4ecd6", fontsize=MIN_PT)
    ax.text(6.45, 3.05, "…", fontsize=TITLE_PT + 8, ha="center", va="center")
    box(ax, 0.4, 1.6, 9.8, 0.5, f"L2 cache: {l2['total_mib']:.0f} MiB, shared by all SMs",
        color="#e1e4f5", fontsize=LABEL_PT)
    ax.text(10.35, 2.95, f"×{g.sms}", fontsize=TITLE_PT, weight="bold", va="center")
    box(ax, 0.4, 0.1, 9.8, 0.7, f"{hbm['name']} (global memory): {g.hbm_gib:.0f} GiB, "
        "off the chip", color="#f6d5d2", edge="#a93226", fontsize=LABEL_PT)
    arrow(ax, (5.3, 1.45), (5.3, 0.8), color="#a93226", style="<|-|>")
    ax.text(5.5, 1.12, f"{hbm['tbs']:.2f} TB/s", fontsize=LABEL_PT, weight="bold",
            color="#a93226", va="center")
    return fig


FIGURES = {
    "slides_02_gpu": gpu,
    "slides_02_roofline": roofline,
    "slides_02_time_floors": time_floors,
    "slides_02_program_order": program_order,
    "slides_02_tiled_matmul": tiled_matmul,
    "slides_02_tile_sweep": tile_sweep,
}
