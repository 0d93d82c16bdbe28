"""Lesson 09b: pictures and small tables for FP8's accuracy (``course_lib.fp8``).

Introduced in notebooks/09b_fp8.ipynb. Nothing here is timed: every number is an error
computed on the CPU from seeded inputs.
"""
from __future__ import annotations

import torch

from course_lib.fp8 import (
    E4M3,
    KIND_LABELS,
    fake_quantize,
    outlier_inputs,
    random_rotation,
)


def e4m3_grid(lo: float = 0.5, hi: float = 4.0) -> list[float]:
    """Every positive e4m3 value in [lo, hi]: eight steps per power of two (three mantissa
    bits), so the step is 2^-3 of the power of two a value lies in."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).double()
    vals = sorted({float(x) for x in codes if torch.isfinite(x) and lo <= float(x) <= hi})
    return vals


def rounding_rows(seed: int = 0, n: int = 100_000) -> list[dict]:
    """Largest and RMS relative rounding error of unit normal numbers, per format."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = x[x.abs() > 2 ** -6]  # far from 0: once scaled, each is a normal number of every format
    rows = []
    for name, dtype in (("fp8 e4m3", E4M3), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        rel = ((fake_quantize(x[None, :, None], dtype, per_tensor=True)[0, :, 0] - x) / x).abs()
        rows.append({"format": name, "max relative error": f"{float(rel.max()):.2e}",
                     "RMS relative error": f"{float(rel.pow(2).mean().sqrt()):.2e}"})
    return rows


def rotation_demo(d: int = 128, n: int = 4096, seed: int = 0) -> dict:
    """Rows of ``outlier_inputs`` before and after ``random_rotation``: the largest entry, the
    RMS entry, and how far (QM)(KM)ᵀ is from QKᵀ."""
    gen = torch.Generator().manual_seed(seed)
    q, k = outlier_inputs((n, d), gen), outlier_inputs((n, d), gen)
    rot = random_rotation(d, seed)
    qr, kr = q @ rot, k @ rot
    return {"q": q, "q_rotated": qr,
            "max |q| before": float(q.abs().max()), "max |q| after": float(qr.abs().max()),
            "rms before": float(q.pow(2).mean().sqrt()),
            "rms after": float(qr.pow(2).mean().sqrt()),
            "largest |QKᵀ − (QM)(KM)ᵀ|": float((q @ k.T - qr @ kr.T).abs().max())}


def plot_rotation(demo: dict):
    """Histograms of the entries of Q before and after the rotation (log counts)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, title in ((axes[0], "q", "Q: a few entries far out"),
                           (axes[1], "q_rotated", "QM: the outliers spread over every channel")):
        ax.hist(demo[key].flatten().numpy(), bins=121, range=(-40, 40), color="tab:blue")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=13)
        ax.set_xlabel("entry value", fontsize=12)
    axes[0].set_ylabel("count (log scale)", fontsize=12)
    return fig


def plot_errors(table: dict):
    """RMS error of O per scheme (log scale), one bar per kind of input."""
    from matplotlib.figure import Figure

    names = list(table["schemes"])
    kinds = list(table["schemes"][names[0]])
    colors = ("tab:blue", "tab:red", "tab:purple", "tab:green")
    fig = Figure(figsize=(10, 4.6), layout="constrained")
    ax = fig.subplots()
    height = 0.8 / len(kinds)
    for n, kind in enumerate(kinds):
        ax.barh([i - 0.4 + (n + 0.5) * height for i in range(len(names))],
                [table["schemes"][name][kind] for name in names], height,
                color=colors[n % len(colors)], label=KIND_LABELS.get(kind, kind))
    ax.set_yticks(range(len(names)), names, fontsize=12)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("RMS error of O against float64 attention (log scale)", fontsize=12)
    fig.legend(fontsize=11, loc="outside upper center", ncols=len(kinds))
    return fig


__all__ = ["e4m3_grid", "plot_errors", "plot_rotation", "rotation_demo", "rounding_rows"]
