"""The roofline model: is an operation limited by arithmetic or by memory traffic?

Introduced in notebooks/02_gpu_memory.ipynb.

An operation that does ``flops`` floating-point operations and moves ``bytes`` between HBM and
the chip has *arithmetic intensity* I = flops / bytes (FLOP per byte). On a GPU with peak
compute P (FLOP/s) and memory bandwidth β (byte/s) it cannot run faster than

    attainable(I) = min(P, β · I)

(Williams, Waterman and Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 52(4), 2009). The two ceilings meet at the *ridge point*
I* = P / β: below it an operation is memory-bound (more FLOPs would be free; fewer bytes
make it faster), above it compute-bound. FlashAttention's argument (Dao et al. 2022, §2) is
that attention's softmax and its S, P matrices sit far left of the ridge.

Where *fused* attention sits depends on what is counted as HBM traffic. FlashAttention v1's IO
model (Algorithm 1 with the paper's block sizes, no cache) re-reads Q and round-trips O, l, m
once per K/V block; FlashAttention-2 re-reads K and V once per Q block, and on a GPU those
re-reads hit the L2 cache, so its DRAM traffic is close to reading Q, K, V and writing O once
(course_lib/data/hbm.json: within a few percent of that floor on an H100). ``lesson_ops(fa2=True)``
puts both on the roofline; the measurements match the second.

The functions here are generic: an operation is ``(name, flops, bytes)``; the course's IO
models (``course_lib.iomodel``) supply the numbers.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from course_lib.hardware import GPUS, GPUSpec, get_gpu

Op = tuple[str, float, float]  # (name, flops, bytes moved to and from HBM)


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity in FLOP per byte."""
    if nbytes <= 0:
        raise ValueError(f"bytes must be positive, got {nbytes}")
    if flops < 0:
        raise ValueError(f"flops must be non-negative, got {flops}")
    return flops / nbytes


def attainable_tflops(gpu: GPUSpec | str, intensity_flop_per_byte: float,
                      dtype: str = "fp16") -> float:
    """The roofline: min(peak, bandwidth × intensity), in TFLOP/s."""
    gpu = get_gpu(gpu)
    peak = gpu.peak_tflops(dtype)
    if peak is None or gpu.hbm_tbs is None:
        raise ValueError(f"{gpu.name} has no peak FLOP/s or bandwidth in the table")
    return min(peak, gpu.hbm_tbs * intensity_flop_per_byte)


def classify(gpu: GPUSpec | str, ops: Iterable[Op], dtype: str = "fp16") -> list[dict]:
    """For each op: its intensity, the attainable TFLOP/s, the bound, and the time floor.

    ``time_floor_us`` is max(flops / peak, bytes / bandwidth): no kernel can be faster.
    """
    gpu = get_gpu(gpu)
    peak = gpu.peak_tflops(dtype)
    rows = []
    for name, flops, nbytes in ops:
        i = intensity(flops, nbytes)
        t_compute = flops / (peak * 1e12)
        t_memory = nbytes / (gpu.hbm_tbs * 1e12)
        rows.append({"name": name, "flops": flops, "bytes": nbytes, "intensity": i,
                     "attainable_tflops": attainable_tflops(gpu, i, dtype),
                     "bound": "memory" if i < gpu.ridge_point(dtype) else "compute",
                     "time_floor_us": max(t_compute, t_memory) * 1e6})
    return rows


def roofline(gpu: GPUSpec | str, ops: Sequence[Op], ax=None, dtype: str = "fp16",
             title: str | None = None, xlim: tuple[float, float] | None = None,
             fontsize: float = 10, legend: bool = True):
    """Draw ``gpu``'s compute and bandwidth ceilings and place ``ops`` on them.

    ``ops``: a list of ``(name, flops, bytes)``. Each op is drawn at its arithmetic intensity on
    the roof (the best speed it could reach), numbered; ``legend`` lists them under the axes
    (leave it out where several panels share one, ``fig.legend``). Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    gpu = get_gpu(gpu)
    peak = gpu.peak_tflops(dtype)
    if peak is None or gpu.hbm_tbs is None:
        raise ValueError(f"{gpu.name} has no peak FLOP/s or bandwidth: pass a row of GPUS")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    ridge = gpu.ridge_point(dtype)
    points = [(name, intensity(f, b)) for name, f, b in ops]
    xs = [i for _, i in points] + [ridge]
    lo, hi = xlim or (min(xs) / 4, max(xs) * 4)
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    roof = np.minimum(peak, gpu.hbm_tbs * x)
    ax.loglog(x, roof, color="black", lw=2)
    ax.fill_between(x, roof, roof.min() / 10, color="0.94", zorder=0)
    ax.axvline(ridge, color="0.5", ls=":", lw=1)
    ax.annotate(f"ridge point\n{ridge:.0f} FLOP/B", (ridge, 0.55), xytext=(4, 0),
                xycoords=("data", "axes fraction"), textcoords="offset points", fontsize=fontsize,
                color="0.3")
    label_dtype = {"fp16": "FP16/BF16 tensor cores", "bf16": "FP16/BF16 tensor cores",
                   "fp32": "FP32 CUDA cores"}[_dtype_key(dtype)]
    ax.text(hi, peak * 1.08, f"{label_dtype}: {peak:g} TFLOP/s", ha="right", va="bottom",
            fontsize=fontsize)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^vPX*<>"
    # numbers below the roof, stacked with leader lines where points crowd together
    order = sorted(range(len(points)), key=lambda k: points[k][1])
    stack = {}
    for pos, k in enumerate(order):
        prev = order[pos - 1] if pos else None
        near = prev is not None and points[k][1] < points[prev][1] * 1.5
        stack[k] = stack[prev] + 1 if near else 0
    for k, (name, i) in enumerate(points):
        y = min(peak, gpu.hbm_tbs * i)
        color = colors[k % len(colors)]
        bound = "memory-bound" if i < ridge else "compute-bound"
        ax.plot([i], [y], markers[k % len(markers)], color=color, ms=8, zorder=3, mfc="none",
                mew=2, label=f"{k + 1}. {name}: {_fmt_intensity(i)} FLOP/B, {bound}")
        ax.annotate(str(k + 1), (i, y), xytext=(10 + 12 * stack[k], -18 - 12 * stack[k]),
                    textcoords="offset points", fontsize=fontsize, color=color,
                    fontweight="bold",
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6,
                                "shrinkA": 0, "shrinkB": 4})
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(gpu.hbm_tbs * lo, peak) / 3, peak * 2.5)
    memory = gpu.memory_type or "DRAM"   # HBM3, GDDR6, …: the L4's DRAM is no HBM
    ax.set_xlabel(f"arithmetic intensity (FLOP per byte of {memory} traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title or f"Roofline of the {gpu.name} ({dtype})")
    if legend:
        ax.legend(fontsize=fontsize, loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  ncol=2 if len(points) > 4 else 1, frameon=False)
    ax.grid(True, which="major", alpha=0.3)
    # label the slanted bandwidth roof along its own slope (measured on screen, after limits)
    # in the widest gap between the memory-bound points, so that the label crosses none of them
    stops = sorted([lo] + [i for _, i in points if i < ridge] + [min(ridge, hi)])
    start, _ = max(zip(stops, stops[1:]), key=lambda ab: ab[1] / ab[0])
    x0 = start * 1.4
    (px0, py0), (px1, py1) = ax.transData.transform([(x0, gpu.hbm_tbs * x0),
                                                      (x0 * 2, gpu.hbm_tbs * x0 * 2)])
    angle = np.degrees(np.arctan2(py1 - py0, px1 - px0))
    ax.annotate(f"{gpu.memory_type or 'memory'}: {gpu.hbm_tbs:g} TB/s", (x0, gpu.hbm_tbs * x0),
                xytext=(0, 6), textcoords="offset points", rotation=angle,
                rotation_mode="anchor", fontsize=fontsize)
    return ax


def _fmt_intensity(i: float) -> str:
    return f"{i:,.0f}" if i >= 100 else f"{i:.3g}"


def _dtype_key(dtype) -> str:
    text = str(dtype).replace("torch.", "").lower()
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(text, text)


def compare_gpus(names: Sequence[str] | None = None, dtype: str = "fp16") -> list[dict]:
    """The ridge point of each GPU: how many FLOPs it must do per byte to be compute-bound."""
    names = list(GPUS) if names is None else list(names)
    return [{"gpu": n, "peak_tflops": get_gpu(n).peak_tflops(dtype),
             "hbm_tbs": get_gpu(n).hbm_tbs, "ridge_flop_per_byte": get_gpu(n).ridge_point(dtype)}
            for n in names]


def lesson_ops(gpu: GPUSpec | str = "H100-SXM", N: int = 4096, d: int = 64, B: int = 1,
               H: int = 16, matmul_n: int = 4096, tile: int = 128,
               bytes_per_el: int = 2, fa2: bool = False) -> list[Op]:
    """The operations notebook 02 places on the roofline, counted by the course's IO models.

    * an n³ matmul three ways (``course_lib.iomodel.matmul``): naive (every operand from HBM),
      ``tile``×``tile`` tiles with no cache help, and the floor (each matrix moved once);
    * the three kernels of standard attention and fused attention as FlashAttention v1's IO
      model counts it (Algorithm 1 with the paper's block sizes for this GPU's shared memory,
      no cache: Q re-read and O, l, m round-tripped once per K/V block) for B·H heads of N×d
      (``course_lib.iomodel.attention``);
    * with ``fa2``, last: FlashAttention-2 with its K/V re-reads served by L2, i.e. Q, K, V
      read and O, lse written once (``compulsory_io``), which is what the H100's DRAM counters
      measure (course_lib/data/hbm.json).
    """
    from course_lib.iomodel.attention import (
        compulsory_io,
        flash_attention_io,
        standard_attention_steps,
    )
    from course_lib.iomodel.matmul import (
        matmul_compulsory_bytes,
        matmul_flops,
        matmul_hbm_bytes,
    )

    gpu = get_gpu(gpu)
    n = matmul_n
    flops = matmul_flops(n, n, n)
    ops: list[Op] = [
        (f"matmul {n}³, naive", flops, matmul_hbm_bytes(n, n, n, None, bytes_per_el)),
        (f"matmul {n}³, {tile}² tiles, no cache", flops,
         matmul_hbm_bytes(n, n, n, tile, bytes_per_el)),
        (f"matmul {n}³, each matrix once", flops,
         matmul_compulsory_bytes(n, n, n, bytes_per_el)),
    ]
    for step in standard_attention_steps(N, d, B=B, H=H, bytes_per_el=bytes_per_el):
        ops.append((f"attention: {step['name']}", step["flops"], step["hbm_bytes"]))
    M = gpu.smem_per_sm_bytes // bytes_per_el   # SRAM of one SM, in elements
    fused = flash_attention_io(N, d, M, B=B, H=H, bytes_per_el=bytes_per_el)
    ops.append(("fused: FlashAttention v1 model (no cache)", fused["flops"], fused["hbm_bytes"]))
    if fa2:
        floor = compulsory_io(N, N, d, B=B, H=H, bytes_per_el=bytes_per_el)
        ops.append(("fused: FlashAttention-2, K/V re-reads in L2", floor["flops"],
                    floor["hbm_bytes"]))
    return ops


def _roofline_figure():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 7.5))
    roofline("H100-SXM", lesson_ops("H100-SXM", fa2=True), ax=ax,
             title="Roofline of the H100 SXM (fp16): N = 4096, d = 64, 16 heads")
    fig.tight_layout()
    return fig


FIGURES = {"roofline": _roofline_figure}
"""Figures this module draws: name -> function returning a matplotlib Figure (for images/)."""
