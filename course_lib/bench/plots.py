"""Figures of the stored benchmark results (course_lib/data/*.json), one function each.

Introduced in notebooks/07_triton_flash_v1.ipynb. Each function takes the loaded JSON and
returns a matplotlib ``Figure`` (no pyplot state, so it works headless and in notebooks).
``FIGURES`` maps an image stem (``images/<stem>.png``) to a function of no argument that
loads the stored result and draws it, or returns None where nothing was measured yet.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from course_lib.bench.common import load_result

_STYLE = {"v1": dict(color="tab:gray", ls="--", marker="x"),
          "sdpa-FLASH_ATTENTION": dict(color="tab:blue", marker="o"),
          "sdpa-CUDNN_ATTENTION": dict(color="tab:purple", marker="s"),
          "sdpa-EFFICIENT_ATTENTION": dict(color="tab:olive", marker="^"),
          "sdpa-MATH": dict(color="tab:brown", marker="v")}
_V2_COLORS = ("tab:red", "tab:orange", "tab:green", "tab:pink")


def _style(name: str, providers: list[str]) -> dict:
    if name in _STYLE:
        return _STYLE[name]
    v2 = [p for p in providers if p.startswith("v2-")]
    i = v2.index(name) if name in v2 else 0
    return dict(color=_V2_COLORS[i % len(_V2_COLORS)], marker="D", lw=2)


def _title(result: dict, what: str) -> str:
    env = result.get("environment", {})
    return (f"{what} on {env.get('gpu', env.get('device', '?'))} "
            f"(torch {env.get('torch', '?')}, triton {env.get('triton', '?')})")


def plot_attention(result: dict) -> Figure:
    """TFLOP/s against N for every provider; one panel per (head dim, causal)."""
    panels = sorted({(r["D"], r["causal"]) for r in result["rows"]})
    fig = Figure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (d, causal) in zip(axes, panels):
        rows = sorted((r for r in result["rows"] if r["D"] == d and r["causal"] == causal),
                      key=lambda r: r["N"])
        for name in result["providers"]:
            pts = [(r["N"], r["results"].get(name, {}).get("tflops")) for r in rows]
            pts = [(n, t) for n, t in pts if t is not None]
            if pts:
                ax.plot(*zip(*pts), label=name, **_style(name, result["providers"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["N"] for r in rows], [f"{r['N'] // 1024}k" if r["N"] >= 1024
                                               else str(r["N"]) for r in rows])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(f"D = {d}, {'causal' if causal else 'non-causal'}")
    axes[0].legend(fontsize=8)
    rounds = result.get("rounds", 1)
    harness = ("every provider called eagerly, do_bench median"
               + (f" of {rounds} interleaved rounds" if rounds > 1 else ""))
    fig.suptitle(_title(result, f"attention {result['mode']} ({result['dtype']}), "
                                f"FLOPs = {result['flops_formula']},") + "\n" + harness)
    return fig


def plot_hbm(result: dict) -> Figure:
    """Measured DRAM bytes per implementation: read and written side by side, their total as a
    tick, the IO model's prediction as a diamond (log scale, its bottom below the smallest bar)."""
    import numpy as np

    rows = [r for r in result["rows"] if r.get("read_gb") is not None]
    fig = Figure(figsize=(8, 4.6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(rows))
    read = [r["read_gb"] for r in rows]
    write = [r["write_gb"] for r in rows]
    ax.bar(x - 0.2, read, 0.4, label="read (measured)", color="tab:blue")
    ax.bar(x + 0.2, write, 0.4, label="written (measured)", color="tab:orange")
    ax.hlines([r + w for r, w in zip(read, write)], x - 0.4, x + 0.4, color="black", lw=2,
              zorder=3, label="total (measured)")
    pred = [(i, r["predicted_gb"]) for i, r in enumerate(rows) if r.get("predicted_gb")]
    if pred:
        ax.scatter(*zip(*pred), marker="D", s=30, facecolor="white", edgecolor="black",
                   zorder=4, label="total, IO-model prediction")
    ax.axhline(result["minimum_gb"], color="gray", ls=":",
               label="minimum: Q, K, V read, O and lse written once")
    ax.set_yscale("log")
    low = min(read + write + [result["minimum_gb"]])
    high = max(r + w for r, w in zip(read, write))
    ax.set_ylim(low / 3, high * 40)  # room above the bars for the legend
    ax.set_ylabel("GB moved to and from HBM")
    ax.set_xticks(x, [r["target"] for r in rows], rotation=30, ha="right",
                  rotation_mode="anchor")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9, loc="upper right")
    s = result["shape"]
    fig.suptitle(_title(result, f"HBM traffic, B={s['B']} H={s['H']} N={s['N']} d={s['D']} "
                                f"{s['dtype']} forward,"), fontsize=9)
    return fig


def save_figure(fig: Figure, path: Path, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _stored(name: str, draw):
    def make():
        result = load_result(name)
        return None if result is None else draw(result)
    return make


FIGURES = {
    "bench_attention_fwd": _stored("attention_fwd", plot_attention),
    "bench_attention_bwd": _stored("attention_bwd", plot_attention),
    "bench_hbm": _stored("hbm", plot_hbm),
}
