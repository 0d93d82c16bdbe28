"""The GPU memory hierarchy of an H100 SXM: registers, shared memory / L1, L2, HBM.

Introduced in notebooks/02_gpu_memory.ipynb. Sizes and the HBM bandwidth come from
``course_lib.hardware`` (NVIDIA's H100 datasheet and Hopper whitepaper, the CUDA C++
Programming Guide's per-compute-capability table). The shared-memory bandwidth is derived, not
quoted: 32 banks of 4 bytes give 128 bytes per clock per SM (CUDA C++ Programming Guide,
"Shared Memory"), at the clock of the datasheet's tensor-core peak (989.4 TFLOP/s over 132 SMs
at 4096 dense fp16 FLOPs per SM per clock, ``analysis.hopper.MMA_FLOPS_PER_SM_CYCLE``).
NVIDIA publishes no bandwidth for the L2 cache or the registers; the picture says so.
"""
from __future__ import annotations

from course_lib.hardware import GPUSpec, get_gpu

SMEM_BYTES_PER_SM_CLOCK = 128
"""Shared memory: 32 banks, each 32 bits wide per clock (CUDA C++ Programming Guide)."""

FONT = 12


def hierarchy(gpu: GPUSpec | str = "H100-SXM") -> list[dict]:
    """The four levels, fastest first: name, where, size per SM and in all, bandwidth, owner."""
    from course_lib.analysis.hopper import MMA_FLOPS_PER_SM_CYCLE

    g = get_gpu(gpu)
    clock_hz = g.fp16_tensor_tflops * 1e12 / (g.sms * MMA_FLOPS_PER_SM_CYCLE)
    smem_tbs = g.sms * SMEM_BYTES_PER_SM_CLOCK * clock_hz / 1e12
    return [
        {"name": "registers", "per_sm_kib": g.regs_per_sm_kib,
         "total_mib": g.sms * g.regs_per_sm_kib / 1024, "tbs": None,
         "owner": "the compiler; private to one thread"},
        {"name": "shared memory / L1", "per_sm_kib": g.smem_per_sm_kib,
         "total_mib": g.smem_total_mib, "tbs": smem_tbs, "clock_ghz": clock_hz / 1e9,
         "owner": "you (shared by one block)"},
        {"name": "L2 cache", "per_sm_kib": None, "total_mib": g.l2_mib, "tbs": None,
         "owner": "the hardware; shared by all SMs"},
        {"name": g.memory_type or "HBM", "per_sm_kib": None, "total_mib": g.hbm_gib * 1024,
         "tbs": g.hbm_tbs, "owner": "you (allocations); off the chip"},
    ]


def _box(ax, x, y, w, h, color, edge="black", lw=1.5, ls="-"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.35",
                                facecolor=color, edgecolor=edge, lw=lw, ls=ls))


def _arrow(ax, x, y0, y1, color="0.25", lw=2.2):
    ax.annotate("", xy=(x, y1), xytext=(x, y0),
                arrowprops={"arrowstyle": "<|-|>", "color": color, "lw": lw,
                            "mutation_scale": 16, "shrinkA": 0, "shrinkB": 0})


def memory_hierarchy_figure(gpu: GPUSpec | str = "H100-SXM"):
    """The chip (SMs with their registers and shared memory, the L2 they share) above its HBM,
    each level labelled with its size and, where NVIDIA gives or implies one, its bandwidth."""
    from matplotlib.figure import Figure

    g = get_gpu(gpu)
    reg, smem, l2, hbm = hierarchy(g)
    fig = Figure(figsize=(12.5, 6.4), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 62)
    ax.set_axis_off()

    # the chip, its SMs, the L2
    _box(ax, 1, 20, 60, 41, "#f3f6fb", edge="#4C72B0", lw=2)
    ax.text(3, 58.5, f"{g.name.replace('NVIDIA ', '')}: one chip", fontsize=FONT + 1,
            weight="bold", color="#2b4a7a", va="center")
    ax.text(59, 58.5, f"{g.fp16_tensor_tflops:g} TFLOP/s (fp16 tensor cores, all SMs)",
            fontsize=FONT - 1, ha="right", va="center", color="#2b4a7a")
    w = 15.5
    for x, label in zip((4, 21, 40.5), ("SM 0", "SM 1", f"SM {g.sms - 1}")):
        _box(ax, x, 34, w, 21, "white", edge="0.3")
        ax.text(x + w / 2, 52.6, label, ha="center", va="center", fontsize=FONT, weight="bold")
        _box(ax, x + 0.8, 44, w - 1.6, 6.5, "#fde2c4", edge="#c7711f")
        ax.text(x + w / 2, 47.25, f"registers\n{reg['per_sm_kib']:g} KiB", ha="center",
                va="center", fontsize=FONT - 1)
        _box(ax, x + 0.8, 35.5, w - 1.6, 7.5, "#d5ecd9", edge="#3f8f52")
        ax.text(x + w / 2, 39.25, f"shared mem / L1\n≤ {smem['per_sm_kib']:g} KiB",
                ha="center", va="center", fontsize=FONT - 1)
        _arrow(ax, x + w / 2, 34, 29.5)
    ax.text(38.5, 44.5, "…", fontsize=FONT + 10, ha="center", va="center")
    _box(ax, 4, 22, 52, 7.5, "#dfe3f5", edge="#4b56a8")
    ax.text(30, 25.75, f"L2 cache: {l2['total_mib']:g} MiB, shared by all {g.sms} SMs",
            ha="center", va="center", fontsize=FONT)

    # off the chip
    _arrow(ax, 30, 22, 13.5, color="#b03a2e", lw=3)
    ax.text(31.5, 17.2, f"{hbm['tbs']:g} TB/s", fontsize=FONT + 1, color="#b03a2e",
            weight="bold", va="center")
    _box(ax, 4, 3, 52, 10.5, "#f6d4d0", edge="#b03a2e")
    ax.text(30, 8.25, f"{hbm['name']} (global memory): {hbm['total_mib'] / 1024:g} GiB, "
            f"off the chip", ha="center", va="center", fontsize=FONT)

    # one line per level, beside it: size in all, bandwidth, who manages it
    notes = [
        (47.25, "#c7711f", f"registers: {reg['total_mib']:.0f} MiB in all",
         "fastest; no published bandwidth", reg["owner"]),
        (39.25, "#3f8f52", f"shared memory: {smem['total_mib']:.1f} MiB in all",
         f"≈ {smem['tbs']:.0f} TB/s: {SMEM_BYTES_PER_SM_CLOCK} B per clock per SM "
         f"at {smem['clock_ghz']:.2f} GHz", smem["owner"]),
        (25.75, "#4b56a8", f"L2: {l2['total_mib']:g} MiB",
         "no bandwidth in NVIDIA's documents", l2["owner"]),
        (8.25, "#b03a2e", f"{hbm['name']}: {hbm['total_mib'] / 1024:g} GiB",
         f"{hbm['tbs']:g} TB/s (datasheet)", hbm["owner"]),
    ]
    for y, color, head, speed, owner in notes:
        ax.text(63, y + 2.6, head, fontsize=FONT, weight="bold", color=color, va="center")
        ax.text(63, y, speed, fontsize=FONT - 1, va="center")
        ax.text(63, y - 2.6, owner, fontsize=FONT - 1, va="center", color="0.35")
    ratio = smem["tbs"] / hbm["tbs"]
    ax.text(63, 17.2, f"on chip: small and ≈ {ratio:.0f}× faster;\noff chip: large and slow",
            fontsize=FONT - 1, va="center", style="italic", color="0.3")
    return fig


FIGURES = {"02_memory_hierarchy": memory_hierarchy_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
