"""The tile walk: FlashAttention's loops one block step at a time, with what is in SRAM and HBM.

Introduced in notebooks/06_flash_v1_algorithm.ipynb.

``record_walk`` runs ``course_lib.reference.flash_v1_reference`` (or ``flash_v2_reference``) on
a small random problem with an ``HBMCounter`` and a trace, and keeps one snapshot per step.
``draw_step`` draws one snapshot with matplotlib:

* the score matrix, one cell per (query, key): blocks already computed are shaded, the S block
  being computed is outlined in red, causal-masked scores are grey;
* the HBM tensors beside it: Q and O (rows), K and V (columns); blocks now in SRAM in colour;
* each row's running max m and normaliser l as they stand after the step (v1: the values in
  HBM; v2: the values in registers for the current Q block, final ones for finished blocks);
* the HBM counter: elements read and written so far, per tensor.

``tile_walk()`` wraps it in ipywidgets (a step slider, a v1/v2 toggle, a causal switch);
``static_tile_walk()`` is the PNG fallback: four steps of v1 side by side.
"""
from __future__ import annotations

import math

import torch

from course_lib.iomodel.attention import HBMCounter
from course_lib.reference import causal_mask, flash_v1_reference, flash_v2_reference


def record_walk(N_q=12, N_k=16, d=4, block_m=4, block_n=4, order="v1", causal=False, seed=0):
    """Run the v1 (K/V outer) or v2 (Q outer) loops and return one snapshot per block step.

    Each snapshot: order, i, j, rows, cols, the (i, j) pairs done so far, every row's m and l
    after the step (numpy arrays of N_q), and the HBM counter's reads and writes so far.
    """
    if order not in ("v1", "v2"):
        raise ValueError(f"order must be 'v1' or 'v2', got {order!r}")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, d, generator=gen) for n in (N_q, N_k, N_k))
    hbm = HBMCounter(bytes_per_el=4)
    m = torch.full((N_q,), float("-inf"))
    l = torch.zeros(N_q)
    steps, done = [], []

    def on_step(t):
        r0, r1 = t["rows"]
        m[r0:r1], l[r0:r1] = t["m"], t["l"]
        done.append((t["i"], t["j"]))
        steps.append({"order": t["order"], "i": t["i"], "j": t["j"], "rows": t["rows"],
                      "cols": t["cols"], "done": list(done), "m": m.numpy().copy(),
                      "l": l.numpy().copy(), "hbm": t["hbm"]})

    fn = flash_v1_reference if order == "v1" else flash_v2_reference
    fn(q, k, v, block_m, block_n, causal=causal, hbm=hbm, trace=on_step)
    meta = {"N_q": N_q, "N_k": N_k, "d": d, "block_m": block_m, "block_n": block_n,
            "causal": causal, "order": order, "final_hbm": hbm.snapshot()}
    for s in steps:
        s["meta"] = meta
    return steps


def _rect(ax, x, y, w, h, **kw):
    import matplotlib.patches as mpatches

    ax.add_patch(mpatches.Rectangle((x, y), w, h, **kw))


def draw_step(steps, t, fig=None):
    """Draw snapshot ``t`` of ``record_walk``'s list; returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    s, meta = steps[t], steps[t]["meta"]
    N_q, N_k, bm, bn = meta["N_q"], meta["N_k"], meta["block_m"], meta["block_n"]
    if fig is None:
        fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax, ax_ml = fig.subplots(1, 2, width_ratios=[N_k + 4.5, 3.5])
    # --- the score matrix, with Q/O as columns on the left and K/V as rows on top (x: key,
    # y: query, origin top-left); SRAM residents in colour
    ax.set_xlim(-4.5, N_k + 0.2)
    ax.set_ylim(N_q + 2.2, -3.5)
    ax.set_aspect("equal")
    ax.axis("off")
    if meta["causal"]:
        visible = causal_mask(N_q, N_k).numpy()
        for r in range(N_q):
            for c in range(N_k):
                if not visible[r, c]:
                    _rect(ax, c, r, 1, 1, color="0.85", lw=0)
    for i, j in s["done"][:-1]:
        _rect(ax, j * bn, i * bm, min(bn, N_k - j * bn), min(bm, N_q - i * bm),
              color="C0", alpha=0.18, lw=0)
    (r0, r1), (c0, c1) = s["rows"], s["cols"]
    _rect(ax, c0, r0, c1 - c0, r1 - r0, fill=False, ec="C3", lw=2.5)
    ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"S$_{{{s['i']}{s['j']}}}$", ha="center",
            va="center", color="C3", fontsize=12)
    for x in range(0, N_k + 1, bn):
        ax.plot([x, x], [0, N_q], color="k", lw=0.6)
    for y in range(0, N_q + 1, bm):
        ax.plot([0, N_k], [y, y], color="k", lw=0.6)
    ax.plot([N_k, N_k], [0, N_q], color="k", lw=0.6)
    ax.plot([0, N_k], [N_q, N_q], color="k", lw=0.6)
    # HBM strips: Q and O (rows) at the left, K and V (columns) on top
    for label, x0, color in (("Q", -4, "C2"), ("O", -2, "C4")):
        ax.text(x0 + 0.75, -0.5, label, ha="center", fontsize=10)
        for i in range(math.ceil(N_q / bm)):
            h = min(bm, N_q - i * bm)
            on = i == s["i"]
            _rect(ax, x0, i * bm, 1.5, h, color=color if on else "white", ec="k", lw=0.6,
                  alpha=0.8 if on else 1)
    for label, y0, color in (("K", -3.2, "C1"), ("V", -1.7, "C5")):
        ax.text(-0.3, y0 + 0.7, label, ha="right", va="center", fontsize=10)
        for j in range(math.ceil(N_k / bn)):
            w = min(bn, N_k - j * bn)
            on = j == s["j"]
            _rect(ax, j * bn, y0, w, 1.4, color=color if on else "white", ec="k", lw=0.6,
                  alpha=0.8 if on else 1)
    loop = "outer j (K/V), inner i (Q)" if meta["order"] == "v1" else "outer i (Q), inner j (K/V)"
    ax.set_title(f"{meta['order']} step {t + 1}/{len(steps)}: (i, j) = ({s['i']}, {s['j']}); "
                 f"{loop}", fontsize=10)
    # --- m and l of every row, and the HBM counter
    ax_ml.axis("off")
    ax_ml.set_xlim(0, 4.5)
    ax_ml.set_ylim(N_q + 2.2, -3.5)
    ax_ml.text(0.2, -0.5, "row", fontsize=9)
    ax_ml.text(1.6, -0.5, "m", fontsize=9)
    ax_ml.text(3.4, -0.5, "l", fontsize=9)
    for r in range(N_q):
        now = r0 <= r < r1
        kw = {"fontsize": 8, "va": "center", "color": "C3" if now else "k"}
        ax_ml.text(0.2, r + 0.5, str(r), **kw)
        m, l = s["m"][r], s["l"][r]
        ax_ml.text(1.2, r + 0.5, "-inf" if m == float("-inf") else f"{m:+.3f}", **kw)
        ax_ml.text(3.0, r + 0.5, f"{l:.3f}", **kw)
    hbm = s["hbm"]
    reads = ", ".join(f"{k} {n}" for k, n in hbm["reads"].items())
    writes = ", ".join(f"{k} {n}" for k, n in hbm["writes"].items())
    ax.text(-4.5, N_q + 1.0, f"coloured blocks: in SRAM now. HBM so far (elements):\n"
            f"read {reads}\nwritten {writes}; total {hbm['elements']}", fontsize=8, va="center")
    return fig


def tile_walk(N_q=12, N_k=16, d=4, block_m=4, block_n=4, causal=False):
    """An ipywidgets stepper over the block steps; toggle v1's (j, i) and v2's (i, j) order."""
    import ipywidgets as w
    from IPython.display import display

    walks = {(o, c): record_walk(N_q, N_k, d, block_m, block_n, o, c)
             for o in ("v1", "v2") for c in (False, True)}
    order = w.ToggleButtons(options=["v1", "v2"], description="order")
    is_causal = w.Checkbox(value=causal, description="causal")
    step = w.IntSlider(min=1, max=len(walks[("v1", causal)]), description="step")
    out = w.Output()

    def redraw(*_):
        steps = walks[(order.value, is_causal.value)]
        step.max = len(steps)
        with out:
            out.clear_output(wait=True)
            display(draw_step(steps, min(step.value, len(steps)) - 1))

    for control in (order, is_causal, step):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([order, is_causal]), step, out])


def static_tile_walk(N_q=8, N_k=12, d=4, block_m=4, block_n=4, causal=True):
    """The PNG fallback: four steps of v1 (the first two, a middle one, the last), 2 × 2."""
    from matplotlib.figure import Figure

    steps = record_walk(N_q, N_k, d, block_m, block_n, "v1", causal)
    picks = sorted({0, 1, len(steps) // 2, len(steps) - 1})
    fig = Figure(figsize=(16, 8.4), layout="constrained")
    for sub, t in zip(fig.subfigures(2, 2).flat, picks):
        draw_step(steps, t, fig=sub)
    return fig


FIGURES = {"06_tile_walk": static_tile_walk}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
