"""The block map of attention's variants: which tiles a kernel skips, runs unmasked or runs
masked, and the work that follows, for full, causal, sliding-window and packed attention.

Introduced in notebooks/15_attention_variants.ipynb. A tiled forward (lesson 08, and
``kernels.flash_variants``) cuts the (query, key) plane into BLOCK_M × BLOCK_N tiles. Under a
window (``course_lib.masks``: bottom-right aligned, causal is ``right = 0``) each tile is

* **skipped**: no row of the tile sees any of its keys; its K and V are never loaded;
* **unmasked**: every row sees every key; it runs with no mask;
* **masked**: the rest; it runs, and the mask throws part of its work away

(``masks.block_kind``). ``draw_block_map`` colours the tiles by kind, draws the edges of the
band of visible keys, and prints the counts of ``iomodel.variants.variant_io``: tiles of each
kind, the (query, key) pairs the rows see (the useful work) against the pairs the tiles run
compute, FLOPs and HBM bytes. "varlen-like" packs several sequences one after the other
(FlashAttention's varlen layout): each sequence is tiled and masked on its own, causal within
itself, and the pairs across two sequences are never visited at all.

``block_map_widget()`` puts it under ipywidgets (a variant, its window, N_q, N_k, BLOCK_M,
BLOCK_N, the packed lengths); ``draw_block_map`` and ``FIGURES`` draw the same pictures without
a widget frontend (nbval, CI, slides).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from course_lib import masks
from course_lib.iomodel.variants import block_map, variant_io

try:  # the figures and counts work without ipywidgets; only the widget needs it
    import ipywidgets as widgets
except ImportError:  # pragma: no cover
    widgets = None

VARIANTS = ("full", "causal", "sliding window", "causal + window", "varlen-like")
KINDS = ("skipped", "unmasked", "masked")
#: tile colours by kind, and (code 3) the pairs of two different packed sequences
COLORS = ("#eeeeee", "#4c72b0", "#dd8452", "#ffffff")
D_DEFAULT = 128


def variant_window(variant: str, left: int = -1, right: int = -1) -> tuple[int, int]:
    """The normalised ``(left, right)`` window of ``variant`` (−1: unbounded side). Full and
    causal ignore ``left`` and ``right``; "causal + window" and "varlen-like" (causal within
    each sequence) use ``left`` only.

    >>> variant_window("causal + window", 1024, 7)
    (1024, 0)
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "full":
        return masks.FULL
    if variant == "causal":
        return masks.normalize_window(masks.FULL, causal=True)
    if variant == "sliding window":
        return masks.normalize_window((left, right))
    return masks.normalize_window((left, -1), causal=True)


def parse_lengths(lengths) -> tuple[int, ...]:
    """Packed sequence lengths from "37, 100, 9" or a sequence of ints (each >= 1)."""
    if isinstance(lengths, str):
        parts = [p for p in lengths.replace(";", ",").replace(" ", ",").split(",") if p]
        try:
            lengths = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"lengths must be whole numbers separated by commas, got "
                             f"{lengths!r}") from None
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"give at least one sequence length, each >= 1, got {lengths}")
    return lengths


@dataclass(frozen=True)
class BlockMap:
    """What ``block_map_of`` finds: the tiles of each packed segment and the summed counts."""

    variant: str
    window: tuple[int, int]
    block_m: int
    block_n: int
    d: int
    segments: tuple  # ((q0, k0, n_q, n_k), ...): one for a single sequence
    kinds: tuple     # per segment, iomodel.variants.block_map's kinds
    io: dict         # variant_io, summed over the segments
    baseline: dict   # the same counts for the comparison named by ``baseline_name``
    baseline_name: str

    @property
    def n_q(self) -> int:
        return sum(s[2] for s in self.segments)

    @property
    def n_k(self) -> int:
        return sum(s[3] for s in self.segments)


def _sum_io(parts: list[dict]) -> dict:
    total = {"blocks": {k: sum(p["blocks"][k] for p in parts) for k in KINDS}}
    for key in ("visible_pairs", "computed_pairs", "visible_flops", "computed_flops",
                "read_bytes", "write_bytes", "hbm_bytes"):
        total[key] = sum(p[key] for p in parts)
    return total


def block_map_of(variant: str = "causal", n_q: int = 256, n_k: int = 256, block_m: int = 32,
                 block_n: int = 32, left: int = -1, right: int = -1, lengths=(37, 100, 64, 9),
                 d: int = D_DEFAULT) -> BlockMap:
    """The tiles and the counted work of one variant (``lengths`` only for "varlen-like", whose
    queries and keys are the packed sequences; ``n_q`` and ``n_k`` are then ignored)."""
    for name, value in (("n_q", n_q), ("n_k", n_k), ("block_m", block_m), ("block_n", block_n),
                        ("d", d)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    window = variant_window(variant, left, right)
    if variant == "varlen-like":
        lens = parse_lengths(lengths)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
        segments = tuple((s, s, n, n) for s, n in zip(starts, lens))
        longest = max(lens)
        baseline = variant_io(longest, longest, d, block_m, block_n, window, B=len(lens))
        baseline_name = f"a padded batch ({len(lens)} × {longest})"
    else:
        segments = ((0, 0, n_q, n_k),)
        baseline = variant_io(n_q, n_k, d, block_m, block_n, masks.FULL)
        baseline_name = "full attention of this shape"
    kinds = tuple(block_map(s[2], s[3], block_m, block_n, window) for s in segments)
    parts = [variant_io(s[2], s[3], d, block_m, block_n, window) for s in segments]
    return BlockMap(variant, window, block_m, block_n, d, segments, kinds, _sum_io(parts),
                    baseline, baseline_name)


def _codes(bm: BlockMap) -> np.ndarray:
    """A (n_q, n_k) array of kind codes per (query, key) pair: 0 skipped, 1 unmasked,
    2 masked, 3 between two packed sequences (never visited)."""
    grid = np.full((bm.n_q, bm.n_k), 3, dtype=np.int8)
    for (q0, k0, nq, nk), kinds in zip(bm.segments, bm.kinds):
        for i, row in enumerate(kinds):
            for j, kind in enumerate(row):
                grid[q0 + i * bm.block_m:q0 + min((i + 1) * bm.block_m, nq),
                     k0 + j * bm.block_n:k0 + min((j + 1) * bm.block_n, nk)] = KINDS.index(kind)
    return grid


def _band_edges(ax, bm: BlockMap) -> None:
    """The edges of the visible band, per segment: row i sees the keys from p − left to
    p + right (p = i + n_k − n_q), drawn as staircases, broken where they leave the segment."""
    left, right = bm.window
    for q0, k0, nq, nk in bm.segments:
        rows = np.arange(nq)
        p = rows + nk - nq
        for edge, bounded in ((p - left, left >= 0), (p + right + 1, right >= 0)):
            if not bounded:
                continue
            x = np.where((edge >= 0) & (edge <= nk), edge, np.nan).astype(float)
            ax.plot(k0 + np.repeat(x, 2), q0 + np.stack([rows, rows + 1], 1).ravel(),
                    color="k", lw=1.2)


def _summary(bm: BlockMap) -> str:
    io_, base = bm.io, bm.baseline
    blocks = io_["blocks"]
    total = sum(blocks.values())
    left, right = bm.window
    side = {-1: "∞"}
    lines = [
        f"{bm.variant}: window (left, right) = ({side.get(left, left)}, "
        f"{side.get(right, right)})",
        f"N_q = {bm.n_q}, N_k = {bm.n_k}; tiles {bm.block_m} × {bm.block_n}",
        f"tiles: {total} = {blocks['skipped']} skipped + {blocks['unmasked']} unmasked"
        f" + {blocks['masked']} masked",
        f"pairs the rows see:    {io_['visible_pairs']:,}",
        f"pairs the tiles compute: {io_['computed_pairs']:,}"
        + (f" ({io_['computed_pairs'] / io_['visible_pairs']:.2f}x)"
           if io_["visible_pairs"] else ""),
        f"FLOPs (4·D a pair, D = {bm.d}): {io_['computed_flops']:.3g}",
        f"HBM bytes (fp16/bf16; fp32 lse): {io_['hbm_bytes']:.3g}",
        f"against {bm.baseline_name}:",
        f"  {io_['computed_pairs'] / base['computed_pairs']:.3f}x the computed pairs",
        f"  {io_['hbm_bytes'] / base['hbm_bytes']:.3f}x the HBM bytes",
    ]
    return "\n".join(lines)


def draw_block_map(variant: str = "sliding window", n_q: int = 256, n_k: int = 256,
                   block_m: int = 32, block_n: int = 32, left: int = 96, right: int = 32,
                   lengths=(37, 100, 64, 9), d: int = D_DEFAULT, fig=None, ax=None,
                   summary: bool = True):
    """Draw one block map (and, with ``summary``, its counted work beside it); returns the
    Figure. ``ax``: draw the map only, into this axes."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    bm = block_map_of(variant, n_q, n_k, block_m, block_n, left, right, lengths, d)
    if ax is None:
        if fig is None:
            fig = Figure(figsize=(11, 5.2) if summary else (5.5, 5.2), layout="constrained")
        if summary:
            ax, ax_text = fig.subplots(1, 2, width_ratios=[1.1, 1])
        else:
            ax, ax_text = fig.subplots(), None
    else:
        fig, ax_text = ax.figure, None
    ax.imshow(_codes(bm), cmap=ListedColormap(COLORS), vmin=-0.5, vmax=3.5,
              interpolation="nearest", extent=(0, bm.n_k, bm.n_q, 0), aspect="auto")
    for q0, k0, nq, nk in bm.segments:  # the tile grid (when it is coarse enough to read)
        if -(-nq // bm.block_m) <= 48 and -(-nk // bm.block_n) <= 48:
            for x in range(k0, k0 + nk + 1, bm.block_n):
                ax.plot([x, x], [q0, q0 + nq], color="0.55", lw=0.5)
            for y in range(q0, q0 + nq + 1, bm.block_m):
                ax.plot([k0, k0 + nk], [y, y], color="0.55", lw=0.5)
            ax.plot([k0, k0 + nk, k0 + nk, k0, k0], [q0, q0, q0 + nq, q0 + nq, q0],
                    color="0.3", lw=0.8)
    _band_edges(ax, bm)
    ax.set(xlim=(0, bm.n_k), ylim=(bm.n_q, 0), xlabel="key j", ylabel="query i")
    ax.set_title(f"{bm.variant}, {bm.block_m} × {bm.block_n} tiles", fontsize=12)
    handles = [Patch(facecolor=COLORS[i], edgecolor="0.4", label=k) for i, k in enumerate(KINDS)]
    if variant == "varlen-like":
        handles.append(Patch(facecolor=COLORS[3], edgecolor="0.4",
                             label="another sequence: not visited"))
    ax.legend(handles=handles, loc="upper right", fontsize=10, framealpha=0.9)
    if ax_text is not None:
        ax_text.axis("off")
        ax_text.text(0.0, 1.0, _summary(bm), va="top", ha="left", family="monospace",
                     fontsize=10.5, transform=ax_text.transAxes)
    return fig


def render_png(dpi: int = 80, **kw) -> bytes:
    """``draw_block_map(**kw)`` as PNG bytes (the widget's picture)."""
    fig = draw_block_map(**kw)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


if widgets is not None:
    class BlockMapWidget(widgets.VBox):
        """A variant, its window, the shape and the tiles; the block map and its counts."""

        def __init__(self, variant: str = "sliding window", n_q: int = 256, n_k: int = 256,
                     block_m: int = 32, block_n: int = 32, left: int = 96, right: int = 32,
                     lengths: str = "37, 100, 64, 9", dpi: int = 80):
            self.dpi = dpi
            slider = dict(continuous_update=False, style={"description_width": "initial"})
            self.variant = widgets.Dropdown(options=VARIANTS, value=variant,
                                            description="variant")
            self.n_q = widgets.IntSlider(value=n_q, min=1, max=1024, description="N_q", **slider)
            self.n_k = widgets.IntSlider(value=n_k, min=1, max=1024, description="N_k", **slider)
            self.block_m = widgets.Dropdown(options=[16, 32, 64, 128], value=block_m,
                                            description="BLOCK_M")
            self.block_n = widgets.Dropdown(options=[16, 32, 64, 128], value=block_n,
                                            description="BLOCK_N")
            self.left = widgets.IntSlider(value=left, min=-1, max=1024, description="left",
                                          **slider)
            self.right = widgets.IntSlider(value=right, min=-1, max=1024, description="right",
                                           **slider)
            self.lengths = widgets.Text(value=lengths, description="lengths",
                                        continuous_update=False)
            self.message = widgets.HTML()
            self.image = widgets.Image(format="png")
            controls = (self.variant, self.n_q, self.n_k, self.block_m, self.block_n,
                        self.left, self.right, self.lengths)
            for c in controls:
                c.observe(self._redraw, names="value")
            super().__init__([widgets.HBox([self.variant, self.block_m, self.block_n]),
                              widgets.HBox([self.n_q, self.n_k]),
                              widgets.HBox([self.left, self.right]), self.lengths,
                              self.message, self.image])
            self._redraw()

        def _enable(self):
            """Grey out what the chosen variant ignores."""
            v = self.variant.value
            self.n_q.disabled = self.n_k.disabled = v == "varlen-like"
            self.left.disabled = v in ("full", "causal")
            self.right.disabled = v != "sliding window"
            self.lengths.disabled = v != "varlen-like"

        def _redraw(self, change=None):
            self._enable()
            try:
                png = render_png(dpi=self.dpi, variant=self.variant.value, n_q=self.n_q.value,
                                 n_k=self.n_k.value, block_m=self.block_m.value,
                                 block_n=self.block_n.value, left=self.left.value,
                                 right=self.right.value, lengths=self.lengths.value)
            except ValueError as exc:  # e.g. lengths that are not numbers: say so, keep going
                self.message.value = f"<b>{exc}</b>"
                return
            self.message.value = ""
            self.image.value = png


def block_map_widget(**kw):
    """The interactive block map (``BlockMapWidget``); needs a widget frontend (JupyterLab,
    VS Code, Colab) to move, and ``draw_block_map`` draws the same pictures without one."""
    if widgets is None:  # pragma: no cover
        raise ImportError("ipywidgets is needed: pip install ipywidgets")
    return BlockMapWidget(**kw)


def block_maps_figure():
    """Five variants side by side at N = 256 (N_q = N_k), 32 × 32 tiles."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19, 5.0), layout="constrained")
    cases = (("full", {}), ("causal", {}), ("sliding window", {"left": 96, "right": 32}),
             ("causal + window", {"left": 64}), ("varlen-like", {}))
    for ax, (variant, kw) in zip(fig.subplots(1, len(cases)), cases):
        draw_block_map(variant, 256, 256, 32, 32, ax=ax, **kw)
        window = variant_window(variant, kw.get("left", -1), kw.get("right", -1))
        ax.set_title(f"{variant}\nwindow {window}", fontsize=13)
        handles = ax.get_legend().legend_handles
        ax.get_legend().remove()
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=12)
    return fig


def window_mask_figure():
    """Which keys each query sees (``masks.visible``), one cell per (query, key) pair, for a
    few windows; ``p`` (the query's own key position, bottom-right aligned) is outlined."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    cases = ((16, 16, (-1, 0), "causal"), (16, 16, (4, 0), "causal, left = 4"),
             (16, 16, (3, 2), "left = 3, right = 2"), (8, 16, (5, 0), "N_q = 8 < N_k = 16, "
                                                                     "left = 5"))
    fig = Figure(figsize=(16, 4.8), layout="constrained")
    for ax, (n_q, n_k, window, title) in zip(fig.subplots(1, len(cases)), cases):
        vis = masks.visible(n_q, n_k, window).numpy()
        ax.imshow(vis, cmap=ListedColormap(["#eeeeee", "#4c72b0"]), vmin=0, vmax=1,
                  extent=(0, n_k, n_q, 0), interpolation="nearest")
        for x in range(n_k + 1):
            ax.plot([x, x], [0, n_q], color="white", lw=0.6)
        for y in range(n_q + 1):
            ax.plot([0, n_k], [y, y], color="white", lw=0.6)
        p = np.arange(n_q) + n_k - n_q
        ax.scatter(p + 0.5, np.arange(n_q) + 0.5, marker="s", s=30, facecolors="none",
                   edgecolors="#dd8452", linewidths=1.5)
        ax.set(xlim=(0, n_k), ylim=(n_q, 0), xlabel="key j", ylabel="query i")
        ax.set_title(f"{title}\nwindow_size = {window}", fontsize=13)
    return fig


FIGURES = {"15_window_mask": window_mask_figure, "15_block_maps": block_maps_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
