"""The third regime, drawn: the host's lane and the GPU's lane of a loop of calls.

Introduced in notebooks/12_flash_decoding.ipynb (section 8). A model, not a measurement: each
call costs the host ``t_host`` µs (Python, checks, launches) and the GPU ``t_gpu`` µs (the
kernels). A launch only queues the kernel, so the host moves on at once; a kernel starts when
both its launch has been queued and the previous kernel has finished. ``schedule`` computes
those start times; ``draw_lanes`` draws two cases side by side: the GPU busy all the time when
``t_host < t_gpu``, and idle between kernels when ``t_host > t_gpu`` (overhead-bound).
"""
from __future__ import annotations


def schedule(t_host: float, t_gpu: float, n: int, sync_every: int = 0):
    """(host spans, GPU spans) of ``n`` calls, each a list of (start, end) in µs.

    ``sync_every`` > 0: after that many calls the host waits for the GPU to finish (a value
    read back), as ``validate=True`` does at every call with ``sync_every=1``.
    """
    host, gpu = [], []
    t_h, gpu_free = 0.0, 0.0
    for i in range(n):
        host.append((t_h, t_h + t_host))
        t_h += t_host  # the launch is queued at the end of the host's work
        start = max(t_h, gpu_free)
        gpu.append((start, start + t_gpu))
        gpu_free = start + t_gpu
        if sync_every and (i + 1) % sync_every == 0:
            t_h = max(t_h, gpu_free)  # the host waits for the value it reads
    return host, gpu


def draw_lanes(cases=((10.0, 20.0, 0), (40.0, 20.0, 0), (40.0, 20.0, 1)), n: int = 6):
    """One panel per (t_host, t_gpu, sync_every) case: the host's lane above the GPU's."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 1.6 * len(cases) + 0.6), sharex=True)
    axes = [axes] if len(cases) == 1 else list(axes)
    end = max(schedule(*c[:2], n, c[2])[1][-1][1] for c in cases)
    for ax, (t_host, t_gpu, sync) in zip(axes, cases):
        host, gpu = schedule(t_host, t_gpu, n, sync)
        for lane, spans, color in ((1, host, "#2e86c1"), (0, gpu, "#c0392b")):
            ax.broken_barh([(a, b - a) for a, b in spans], (lane - 0.35, 0.7),
                           facecolors=color, edgecolors="white")
        busy = sum(b - a for a, b in gpu) / gpu[-1][1]
        what = "a read-back every call" if sync == 1 else "no read-back"
        ax.set_title(f"host {t_host:g} µs, GPU {t_gpu:g} µs per call, {what}: "
                     f"{n} calls take {gpu[-1][1]:g} µs, GPU busy {busy:.0%}",
                     fontsize=10, loc="left")
        ax.set_yticks([0, 1], ["GPU", "host"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_xlim(0, end * 1.02)
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlabel("time (µs)")
    fig.tight_layout()
    return fig


FIGURES = {"12_overhead_lanes": draw_lanes}
