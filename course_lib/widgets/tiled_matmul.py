"""A step-by-step picture of tiled matmul: which tiles sit in shared memory, and the HBM bill.

Introduced in notebooks/03_tiled_matmul.ipynb.

C = A·B with A (M, K), B (K, N) is drawn as three grids of elements, B above C and A to its
left. One *step* is one phase of one block: the block that owns a T×T tile of C has copied an
A tile and a B tile from HBM into shared memory (outlined) and accumulates their product into
its C tile (green). The grey shade of each A and B element counts how often it has been read
from HBM so far; the counter adds up the reads, the same numbers as
``course_lib.iomodel.matmul.matmul_traffic``.

* ``draw(m, n, k, tile, step)`` returns a matplotlib Figure (``render_png`` gives PNG bytes);
* ``TiledMatmulWidget`` puts sliders for the tile size and the step in front of it
  (ipywidgets), redrawing into an ``ipywidgets.Image``, so it needs no interactive backend.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from course_lib.iomodel.matmul import matmul_global_reads, tile_shape


@dataclass(frozen=True)
class Step:
    """One phase of one block: rows i0:i1 of C, columns j0:j1, reduction slice k0:k1."""

    index: int
    i0: int
    i1: int
    j0: int
    j1: int
    k0: int
    k1: int
    reads: int          # elements read from HBM in this step (A tile + B tile)
    reads_so_far: int   # including this step


def schedule(m: int, n: int, k: int, tile) -> list[Step]:
    """Every step of the tiled loop nest, in launch order (tile rows, tile columns, phases)."""
    BM, BN, BK = tile_shape(tile)
    steps, total = [], 0
    for i0 in range(0, m, BM):
        for j0 in range(0, n, BN):
            for k0 in range(0, k, BK):
                i1, j1, k1 = min(i0 + BM, m), min(j0 + BN, n), min(k0 + BK, k)
                reads = (i1 - i0) * (k1 - k0) + (k1 - k0) * (j1 - j0)
                total += reads
                steps.append(Step(len(steps), i0, i1, j0, j1, k0, k1, reads, total))
    return steps


def _read_counts(m, n, k, steps: list[Step], upto: int):
    """How many times each element of A and of B has been read from HBM after step ``upto``."""
    a_reads = np.zeros((m, k), dtype=int)
    b_reads = np.zeros((k, n), dtype=int)
    for s in steps[: upto + 1]:
        a_reads[s.i0:s.i1, s.k0:s.k1] += 1
        b_reads[s.k0:s.k1, s.j0:s.j1] += 1
    return a_reads, b_reads


def describe_step(m: int, n: int, k: int, tile, step: int) -> str:
    """One line for the counter: the step, the tiles in shared memory, reads so far."""
    steps = schedule(m, n, k, tile)
    s = steps[_clip(step, len(steps))]
    naive = matmul_global_reads(m, n, k)
    final = steps[-1].reads_so_far
    return (f"step {s.index + 1}/{len(steps)}: C[{s.i0}:{s.i1}, {s.j0}:{s.j1}] += "
            f"A[{s.i0}:{s.i1}, {s.k0}:{s.k1}] · B[{s.k0}:{s.k1}, {s.j0}:{s.j1}]  |  "
            f"HBM reads so far {s.reads_so_far} (+{s.reads} this step); "
            f"when done {final}, naive {naive}")


def _clip(step: int, n_steps: int) -> int:
    if not -n_steps <= step < n_steps:
        raise ValueError(f"step must be in [0, {n_steps}), got {step}")
    return step % n_steps


def draw(m: int = 32, n: int = 32, k: int = 32, tile=16, step: int = 0, figsize=(8.5, 7)):
    """The state after ``step`` (0-based) as a matplotlib Figure (no pyplot: safe anywhere)."""
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    steps = schedule(m, n, k, tile)
    s = steps[_clip(step, len(steps))]
    BM, BN, BK = tile_shape(tile)
    a_reads, b_reads = _read_counts(m, n, k, steps, s.index)
    vmax = max(1, math.ceil(n / BN), math.ceil(m / BM))

    fig = Figure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    gap = max(2, (m + n + k) // 24)
    # coordinates: x grows right, y grows down; A at x in [0, k], C and B at x in [k+gap, ...]
    x_c, y_b = k + gap, -(k + gap)
    greys = LinearSegmentedColormap.from_list("reads", ["white", "0.55"])
    for data, x0, y0 in ((a_reads, 0, 0), (b_reads, x_c, y_b)):
        rows, cols = data.shape
        ax.imshow(data, cmap=greys, vmin=0, vmax=vmax, extent=(x0, x0 + cols, y0 + rows, y0),
                  interpolation="nearest", zorder=0)
    # C: finished tiles light green, the tile being accumulated bright green
    c_state = np.zeros((m, n))
    for t in steps[: s.index + 1]:
        done = t.k1 == k
        c_state[t.i0:t.i1, t.j0:t.j1] = 1.0 if done else 0.5
    c_state[s.i0:s.i1, s.j0:s.j1] = 2.0
    green = LinearSegmentedColormap.from_list("c", ["white", "#b7e4c7", "#2d6a4f"])
    ax.imshow(c_state, cmap=green, vmin=0, vmax=2, extent=(x_c, x_c + n, m, 0),
              interpolation="nearest", zorder=0)

    def grid(x0, y0, rows, cols, br, bc):
        fine = max(rows, cols) <= 64
        for r in range(rows + 1):
            tile_line = r % br == 0 or r == rows
            if fine or tile_line:
                ax.plot([x0, x0 + cols], [y0 + r, y0 + r], color="0.2" if tile_line else "0.85",
                        lw=1.2 if tile_line else 0.4, zorder=1)
        for c in range(cols + 1):
            tile_line = c % bc == 0 or c == cols
            if fine or tile_line:
                ax.plot([x0 + c, x0 + c], [y0, y0 + rows], color="0.2" if tile_line else "0.85",
                        lw=1.2 if tile_line else 0.4, zorder=1)

    grid(0, 0, m, k, BM, BK)
    grid(x_c, y_b, k, n, BK, BN)
    grid(x_c, 0, m, n, BM, BN)
    # the two tiles now in shared memory
    ax.add_patch(Rectangle((s.k0, s.i0), s.k1 - s.k0, s.i1 - s.i0, fill=True, alpha=0.45,
                           color="#1f77b4", lw=0, zorder=2))
    ax.add_patch(Rectangle((s.k0, s.i0), s.k1 - s.k0, s.i1 - s.i0, fill=False,
                           edgecolor="#1f77b4", lw=3, zorder=3))
    ax.add_patch(Rectangle((x_c + s.j0, y_b + s.k0), s.j1 - s.j0, s.k1 - s.k0, fill=True,
                           alpha=0.45, color="#ff7f0e", lw=0, zorder=2))
    ax.add_patch(Rectangle((x_c + s.j0, y_b + s.k0), s.j1 - s.j0, s.k1 - s.k0, fill=False,
                           edgecolor="#ff7f0e", lw=3, zorder=3))
    ax.add_patch(Rectangle((x_c + s.j0, s.i0), s.j1 - s.j0, s.i1 - s.i0, fill=False,
                           edgecolor="#1b4332", lw=3, zorder=3))
    fs = 10
    ax.text(k / 2, m + gap * 0.6, f"A ({m}×{k})", ha="center", va="top", fontsize=fs)
    ax.text(x_c + n / 2, m + gap * 0.6, f"C ({m}×{n})", ha="center", va="top", fontsize=fs)
    ax.text(x_c - gap * 0.4, y_b + k / 2, f"B ({k}×{n})", ha="right", va="center", fontsize=fs)
    # legend block in the empty top-left corner
    naive = matmul_global_reads(m, n, k)
    final = steps[-1].reads_so_far
    # short lines: the block must end left of B's panel (about k cells wide)
    lines = [f"tile {BM}×{BN}×{BK}, step {s.index + 1} of {len(steps)}",
             "in shared memory:",
             f"  A[{s.i0}:{s.i1}, {s.k0}:{s.k1}] (blue)",
             f"  B[{s.k0}:{s.k1}, {s.j0}:{s.j1}] (orange)",
             f"accumulating C[{s.i0}:{s.i1}, {s.j0}:{s.j1}]",
             "  (dark green)",
             "",
             f"HBM reads so far: {s.reads_so_far:,}",
             f"  (+{s.reads:,} this step)",
             f"when done: {final:,}",
             f"naive: {naive:,}",
             "",
             "grey: how often an element",
             "  was read from HBM"]
    ax.text(0, y_b, "\n".join(lines), ha="left", va="top", fontsize=8.5, family="monospace")
    ax.set_xlim(-1, x_c + n + 1)
    ax.set_ylim(m + gap * 1.6, y_b - 1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"Tiled matmul: {s.reads_so_far:,} elements read from HBM after step "
                 f"{s.index + 1}", fontsize=11)
    fig.tight_layout()
    return fig


def render_png(m: int = 32, n: int = 32, k: int = 32, tile=16, step: int = 0,
               dpi: int = 80) -> bytes:
    """``draw(...)`` as PNG bytes."""
    fig = draw(m, n, k, tile, step)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save_png(path, m: int = 32, n: int = 32, k: int = 32, tile=16, step: int = 0,
             dpi: int = 100):
    """Write ``draw(...)`` to ``path`` as a PNG; returns the path."""
    draw(m, n, k, tile, step).savefig(path, format="png", dpi=dpi)
    return path


def _tile_options(n_max: int) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= n_max] or [1]


try:
    import ipywidgets as widgets
except ImportError:  # pragma: no cover - ipywidgets is a course dependency
    widgets = None


if widgets is not None:

    class TiledMatmulWidget(widgets.VBox):
        """Sliders for the tile size and the step, a picture, and the HBM-read counter."""

        def __init__(self, m: int = 32, n: int = 32, k: int = 32, tile: int = 16,
                     tiles=None, dpi: int = 80):
            self.m, self.n, self.k, self.dpi = m, n, k, dpi
            options = list(tiles or _tile_options(max(m, n, k)))
            if tile not in options:
                raise ValueError(f"tile {tile} is not one of the options {options}")
            self.tile_slider = widgets.SelectionSlider(options=options, value=tile,
                                                       description="tile T")
            self.step_slider = widgets.IntSlider(value=0, min=0, description="step",
                                                 max=len(schedule(m, n, k, tile)) - 1,
                                                 continuous_update=False)
            self.counter = widgets.HTML()
            self.image = widgets.Image(format="png")
            self.tile_slider.observe(self._on_tile, names="value")
            self.step_slider.observe(self._redraw, names="value")
            super().__init__([widgets.HBox([self.tile_slider, self.step_slider]), self.counter,
                              self.image])
            self._redraw()

        @property
        def tile(self) -> int:
            return self.tile_slider.value

        @property
        def step(self) -> int:
            return self.step_slider.value

        def _on_tile(self, change=None):
            n_steps = len(schedule(self.m, self.n, self.k, self.tile))
            with self.step_slider.hold_trait_notifications():
                self.step_slider.value = min(self.step_slider.value, n_steps - 1)
                self.step_slider.max = n_steps - 1
            self._redraw()

        def _redraw(self, change=None):
            self.counter.value = ("<code>" + describe_step(self.m, self.n, self.k, self.tile,
                                                            self.step) + "</code>")
            self.image.value = render_png(self.m, self.n, self.k, self.tile, self.step,
                                          dpi=self.dpi)


def tiled_matmul_widget(m: int = 32, n: int = 32, k: int = 32, tile: int = 16, **kw):
    """The interactive visualiser (see ``TiledMatmulWidget``)."""
    if widgets is None:  # pragma: no cover
        raise ImportError("ipywidgets is needed: pip install ipywidgets")
    return TiledMatmulWidget(m, n, k, tile, **kw)


def _static_figure():
    return draw(32, 32, 32, 16, step=3)


FIGURES = {"tiled_matmul": _static_figure}
"""Figures this module draws: name -> function returning a matplotlib Figure (for images/)."""
