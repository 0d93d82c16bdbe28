"""Pictures of how a Triton launch covers its data: the 1-D launch of a vector kernel, a 2-D
block of offsets built by broadcasting and where it lands in flat memory, a block of pointers
walking along K in a tiled matmul, and the order in which programs take C's tiles.

Introduced in notebooks/00_setup.ipynb (``launch_1d_figure``, ``offset_grid_figure``) and
notebooks/03_tiled_matmul.ipynb (``offset_grid_figure``, ``offset_grid_transposed_figure``,
``pointer_walk_figure``, ``program_order_figure``). Drawn for a slide: few cells, large labels.

* ``draw_launch_1d(n_elements, block_size)``: the vector cut into blocks of BLOCK_SIZE, one
  program each, with each program's pid, its offsets ``pid·BLOCK_SIZE + tl.arange(0,
  BLOCK_SIZE)``, and the mask ``offsets < n_elements`` that switches off the lanes of the last
  block that lie past the end;
* ``draw_offset_grid(tile, strides, shape, view, base)``: the column ``offs_m[:, None] *
  stride_m`` and the row ``offs_k[None, :] * stride_k`` around the grid of offsets they
  broadcast to, and the storage as one line of cells with the tile's cells coloured by their
  tile row: contiguous rows for a row-major matrix, rows spread out for a transposed view;
* ``draw_pointer_walk(M, K, N, ...)``: the (BLOCK_M, BLOCK_K) block of pointers into A, built from
  ``offs_m[:, None]`` (a column) and ``offs_k[None, :]`` (a row), at each step of the K loop,
  and the (BLOCK_K, BLOCK_N) block into B walking down; lanes past K are masked;
* ``draw_program_order(num_pid_m, num_pid_n, group_m, wave)``: the program id of every C tile,
  row-major against grouped (``course_lib.kernels.matmul.program_tile``), with the first wave of
  programs shaded and the A row bands and B column bands that wave needs counted.
"""
from __future__ import annotations

import math

PROGRAM_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860")
STEP_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3")
MASKED = "#d9d9d9"
FONT = 15


def _blank(ax):
    """No axis, no ticks (hidden tick labels would still count as the figure's smallest text)."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_axis_off()


def _cell(ax, x, y, w=1.0, h=1.0, color="white", edge="black", lw=1.2, ls="-", alpha=1.0,
          hatch=None):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, lw=lw, ls=ls,
                           alpha=alpha, hatch=hatch))


# ------------------------------------------------------------------------------- lesson 00
def draw_launch_1d(n_elements: int = 13, block_size: int = 4, fig=None):
    """The 1-D launch of a vector kernel: ``cdiv(n_elements, block_size)`` programs, each with
    its pid, its offsets and its mask; the lanes past ``n_elements`` are masked off."""
    import matplotlib.pyplot as plt

    programs = math.ceil(n_elements / block_size)
    lanes = programs * block_size
    if fig is None:
        fig = plt.figure(figsize=(1.05 * lanes + 3.2, 5.8))
    ax = fig.add_axes([0, 0, 1, 1])
    left = 3.4                                           # room for the row names
    rows = {"pid": 4.1, "arange": 3.0, "offsets": 1.9, "mask": 0.8}
    for p in range(programs):
        c = PROGRAM_COLORS[p % len(PROGRAM_COLORS)]
        x0 = left + p * block_size
        _cell(ax, x0 + 0.04, rows["pid"], block_size - 0.08, 0.8, color=c, edge=c)
        ax.text(x0 + block_size / 2, rows["pid"] + 0.4, f"program pid = {p}", ha="center",
                va="center", color="white", fontsize=FONT, weight="bold")
        for lane in range(block_size):
            off = p * block_size + lane
            inside = off < n_elements
            x = x0 + lane
            _cell(ax, x, rows["arange"], color="white", edge="0.5")
            ax.text(x + 0.5, rows["arange"] + 0.5, str(lane), ha="center", va="center",
                    fontsize=FONT, color="0.25")
            _cell(ax, x, rows["offsets"], color=c if inside else MASKED,
                  alpha=0.35 if inside else 1.0, edge="black" if inside else "0.45",
                  ls="-" if inside else "--", hatch=None if inside else "//")
            ax.text(x + 0.5, rows["offsets"] + 0.5, str(off), ha="center", va="center",
                    fontsize=FONT, color="black" if inside else "0.35")
            _cell(ax, x, rows["mask"], color="#b7e4c7" if inside else "#f4b6b6")
            ax.text(x + 0.5, rows["mask"] + 0.5, "T" if inside else "F", ha="center",
                    va="center", fontsize=FONT, weight="bold",
                    color="#1b5e20" if inside else "#b71c1c")
    edge = left + n_elements
    ax.plot([edge, edge], [0.55, 2.95], color="#b71c1c", lw=2.5, ls="--")
    ax.text(edge + 0.12, 0.2, f"n_elements = {n_elements}: lanes past here are masked off",
            ha="center" if lanes - n_elements > 4 else "right", va="center",
            fontsize=FONT - 1, color="#b71c1c")
    ax.text(left - 0.2, rows["pid"] + 0.4, "tl.program_id(0)", ha="right", va="center",
            fontsize=FONT, family="monospace")
    ax.text(left - 0.2, rows["arange"] + 0.5, f"tl.arange(0, {block_size})", ha="right",
            va="center", fontsize=FONT, family="monospace")
    ax.text(left - 0.2, rows["offsets"] + 0.5, "offsets", ha="right", va="center",
            fontsize=FONT, family="monospace")
    ax.text(left - 0.2, rows["mask"] + 0.5, "mask", ha="right", va="center",
            fontsize=FONT, family="monospace")
    ax.text(left + lanes / 2, 5.6,
            f"grid = (cdiv({n_elements}, {block_size}),) = ({programs},): {programs} programs "
            f"of BLOCK_SIZE = {block_size} lanes", ha="center", va="center", fontsize=FONT + 1)
    ax.text(left + lanes / 2, -0.45,
            f"offsets = pid·{block_size} + tl.arange(0, {block_size});   "
            f"mask = offsets < {n_elements}", ha="center", va="center", fontsize=FONT,
            family="monospace")
    ax.set(xlim=(-0.1, left + lanes + 0.3), ylim=(-0.85, 6.0))
    _blank(ax)
    return fig


def launch_1d_figure():
    """The static figure of lesson 00: 13 elements, blocks of 4, so 4 programs, 3 lanes masked."""
    return draw_launch_1d(13, 4)


# ------------------------------------------------------------------------------- lesson 03
def draw_pointer_walk(M: int = 6, K: int = 10, N: int = 7, block_m: int = 4, block_k: int = 4,
                      block_n: int = 4, pid_m: int = 0, pid_n: int = 1, fig=None):
    """The blocks of pointers of one program of the tiled matmul, at every step of its K loop.

    Left: A (M×K), the (BLOCK_M, BLOCK_K) block ``a_ptrs`` at each step k0 = 0, BLOCK_K, …,
    one colour per step; its rows are ``offs_m[:, None]``, its columns ``k0 + offs_k[None, :]``.
    Right: B (K×N) with the (BLOCK_K, BLOCK_N) block ``b_ptrs`` walking down. Lanes past K (and
    past M or N) are hatched: the mask switches them off and the load reads 0 there.
    """
    import matplotlib.pyplot as plt

    steps = math.ceil(K / block_k)
    if fig is None:
        fig = plt.figure(figsize=(13.5, 6.6))
    ax_a = fig.add_axes([0.0, 0.0, 0.56, 0.86])
    ax_b = fig.add_axes([0.6, 0.0, 0.4, 0.86])
    r0, c0 = pid_m * block_m, pid_n * block_n

    def grid(ax, rows, cols, name):
        for i in range(rows):
            for j in range(cols):
                _cell(ax, j, -i - 1, edge="0.6", lw=0.8)
        ax.text(cols / 2, 1.2, name, ha="center", va="bottom", fontsize=FONT + 1)

    grid(ax_a, M, K, f"A: {M} × {K} (M × K)")
    grid(ax_b, K, N, f"B: {K} × {N} (K × N)")
    for s in range(steps):
        c = STEP_COLORS[s % len(STEP_COLORS)]
        k0 = s * block_k
        for i in range(block_m):
            for j in range(block_k):
                row, col = r0 + i, k0 + j
                inside = row < M and col < K
                _cell(ax_a, col, -row - 1, color=c if inside else MASKED, alpha=0.55,
                      edge=c, lw=1.0, ls="-" if inside else "--", hatch=None if inside else "//")
        ax_a.text(k0 + block_k / 2, -r0 + 0.2, f"k0 = {k0}", ha="center", va="bottom",
                  fontsize=FONT, color=c, weight="bold")
        for i in range(block_k):
            for j in range(block_n):
                row, col = k0 + i, c0 + j
                inside = row < K and col < N
                _cell(ax_b, col, -row - 1, color=c if inside else MASKED, alpha=0.55,
                      edge=c, lw=1.0, ls="-" if inside else "--", hatch=None if inside else "//")
        ax_b.text(c0 + block_n + 0.25, -k0 - block_k / 2, f"k0 = {k0}", ha="left", va="center",
                  fontsize=FONT, color=c, weight="bold")
    # the row and column vectors the block of A is built from, at the first step
    ax_a.annotate("", xy=(-0.25, -r0 - block_m), xytext=(-0.25, -r0),
                  arrowprops=dict(arrowstyle="->", lw=2))
    ax_a.text(-0.45, -r0 - block_m / 2, "offs_m[:, None]", ha="right", va="center",
              fontsize=FONT, family="monospace")
    span = steps * block_k
    ax_a.text(span / 2, -max(M, r0 + block_m) - 0.6,
              "a_ptrs: rows offs_m[:, None], columns k0 + offs_k[None, :];\n"
              "each step moves it right by BLOCK_K.\n"
              "Hatched lanes lie past K (or N): masked, they read 0", ha="center", va="top",
              fontsize=FONT)
    ax_b.text(N / 2, -span - 0.5, "b_ptrs: rows k0 + offs_k[:, None],\ncolumns offs_n[None, :];"
              "\nit moves down", ha="center", va="top", fontsize=FONT)
    ax_a.set(xlim=(-4.6, max(K, span) + 0.3), ylim=(-max(M, r0 + block_m) - 3.9, 2.2),
             aspect="equal")
    ax_b.set(xlim=(-0.3, max(N, c0 + block_n) + 3.0), ylim=(-span - 3.6, 2.2), aspect="equal")
    for ax in (ax_a, ax_b):
        _blank(ax)
    fig.suptitle(f"one program (pid_m = {pid_m}, pid_n = {pid_n}), BLOCK_M = {block_m}, "
                 f"BLOCK_K = {block_k}, BLOCK_N = {block_n}: {steps} steps along K = {K}",
                 fontsize=FONT + 1, y=0.985)
    return fig


def pointer_walk_figure():
    """The static figure of lesson 03: K = 10 in steps of 4, so the third step is masked."""
    return draw_pointer_walk()


def draw_offset_grid(tile: tuple[int, int] = (3, 4), strides: tuple[int, int] = (10, 1),
                     shape: tuple[int, int] = (4, 10), view: str = "x", base: str = "x",
                     fig=None):
    """How a 2-D block of offsets is built, and where it lands in flat memory.

    Top: the column ``offs_m[:, None] * stride_m`` and the row ``offs_k[None, :] * stride_k``
    around the (tile_m, tile_k) grid they broadcast to, an addition table: each cell is its
    column entry plus its row entry. Bottom: the storage of ``base`` as one line of cells,
    0, 1, 2, …, the tile's cells coloured by the tile row they belong to; arcs above show one
    step down a tile column (``stride_m``), arcs or a bracket below one row of the tile
    (``stride_k``). ``view`` (of ``shape``) is what the kernel reads: ``base`` itself, or a
    view of it such as its transpose, with the strides swapped.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    tm, tk = tile
    sm, sk = strides
    storage = (shape[0] - 1) * sm + (shape[1] - 1) * sk + 1
    offsets = [[i * sm + j * sk for j in range(tk)] for i in range(tm)]
    if fig is None:
        fig = plt.figure(figsize=(0.33 * storage + 0.6, 6.6))
    ax = fig.add_axes([0, 0, 1, 1])
    g = 2.0                                          # a grid cell, in memory cells
    col_x, grid_x, grid_y = 9.0, 11.4, 5.2           # column vector, grid: left edges; bottom
    top = grid_y + tm * g                            # the grid's top edge; the row sits above
    row_y = top + 0.4

    def colour(i):
        return PROGRAM_COLORS[i % len(PROGRAM_COLORS)]

    # the column vector, the row vector, and the grid they broadcast to
    for i in range(tm):
        y = top - (i + 1) * g
        _cell(ax, col_x, y, g, g, color="0.92")
        ax.text(col_x + g / 2, y + g / 2, str(i * sm), ha="center", va="center",
                fontsize=FONT + 1)
        for j in range(tk):
            x = grid_x + j * g
            _cell(ax, x, y, g, g, color=colour(i), alpha=0.45)
            ax.text(x + g / 2, y + g / 2, str(offsets[i][j]), ha="center", va="center",
                    fontsize=FONT + 2, weight="bold")
    for j in range(tk):
        _cell(ax, grid_x + j * g, row_y, g, g, color="0.92")
        ax.text(grid_x + j * g + g / 2, row_y + g / 2, str(j * sk), ha="center", va="center",
                fontsize=FONT + 1)
    ax.text(col_x + g / 2, row_y + g / 2, "+", ha="center", va="center", fontsize=FONT + 10)
    ax.text(col_x - 0.3, top - tm * g / 2, f"offs_m[:, None]\n* stride_m\n({tm}, 1)",
            ha="right", va="center", fontsize=FONT, family="monospace", linespacing=1.4)
    ax.text(grid_x + tk * g / 2, row_y + g + 0.3, f"offs_k[None, :] * stride_k   (1, {tk})",
            ha="center", va="bottom", fontsize=FONT, family="monospace")
    ax.text(grid_x + tk * g / 2, grid_y - 0.3, f"the sum: ({tm}, {tk}) offsets",
            ha="center", va="top", fontsize=FONT)
    shown = " × ".join(map(str, shape))
    where = "row-major" if base == view else f"a view of {base}'s memory, no copy"
    lines = (f"{view}: {shown}, {where}",
             f"{view}.stride() = ({sm}, {sk})",
             f"stride_m = {sm}: one row down",
             f"stride_k = {sk}: one column right",
             f"offs_m = {list(range(tm))},  offs_k = {list(range(tk))}",
             "each cell = its column entry + its row entry")
    for n, line in enumerate(lines):
        ax.text(grid_x + tk * g + 1.6, top + g - 0.2 - n * 1.25, line, ha="left", va="top",
                fontsize=FONT + (1 if n < 2 else 0),
                family="monospace" if n in (1, 4) else None)

    # flat memory: one line of cells, the tile's cells coloured by their tile row
    row_of = {offsets[i][j]: i for i in range(tm) for j in range(tk)}
    for o in range(storage):
        inside = o in row_of
        _cell(ax, o, 0, color=colour(row_of[o]) if inside else "white",
              alpha=0.45 if inside else 1.0, edge="black" if inside else "0.55",
              lw=1.2 if inside else 0.8)
        ax.text(o + 0.5, 0.5, str(o), ha="center", va="center", fontsize=FONT - 2,
                color="black" if inside else "0.45", weight="bold" if inside else "normal")
    ax.text(0, 3.4, f"{base}'s memory: {storage} elements in one line, the tile's cells "
            f"coloured by their row in the tile", ha="left", va="center", fontsize=FONT)

    def arc(a, b, color, label, below=False, h=0.8):
        """An arrow from cell a to cell b, bending h cells above the strip (or below)."""
        y, sign = (-0.05, -1) if below else (1.05, 1)
        ax.add_patch(FancyArrowPatch((a + 0.5, y), (b + 0.5, y), arrowstyle="-|>",
                                     connectionstyle=f"arc3,rad={-sign * 2 * h / (b - a)}",
                                     mutation_scale=14, lw=1.6, color=color))
        ax.text((a + b) / 2 + 0.5, y + sign * (h + 0.1), label, ha="center",
                va="top" if below else "bottom", fontsize=FONT - 2, color=color)

    for i in range(tm - 1):                          # down a column of the tile: + stride_m
        arc(offsets[i][0], offsets[i + 1][0], "black", f"+{sm}")
    first = offsets[0]
    if sk == 1:                                      # a row of the tile: neighbours
        ax.plot([first[0] + 0.1, first[0] + 0.1, first[-1] + 0.9, first[-1] + 0.9],
                [-0.15, -0.45, -0.45, -0.15], color=colour(0), lw=2)
        ax.text(first[0] + 0.1, -0.7, f"row 0 of the tile: {tk} neighbours", ha="left",
                va="top", fontsize=FONT - 1, color=colour(0), weight="bold")
    else:                                            # a row of the tile: spread out
        for a, b in zip(first, first[1:]):
            arc(a, b, colour(0), f"+{sk}", below=True)
        ax.text(first[-1] + 1.4, -0.5, f"row 0 of the tile:\n{tk} cells, {sk} apart",
                ha="left", va="top", fontsize=FONT - 1, color=colour(0), weight="bold")
    row = f"one run of {tk} neighbours" if sk == 1 else f"{tk} cells, {sk} apart"
    ax.text(storage / 2, -2.3, f"a row of the tile is {row}; the next row starts "
            f"stride_m = {sm} later", ha="center", va="center", fontsize=FONT)
    ax.set(xlim=(-0.3, storage + 0.3), ylim=(-2.8, row_y + g + 1.4), aspect="equal")
    _blank(ax)
    return fig


def offset_grid_figure():
    """The static figure of lessons 00 and 03: a 3 × 4 tile of a row-major 4 × 10 matrix."""
    return draw_offset_grid()


def offset_grid_transposed_figure():
    """The static figure of lesson 03: the same tile of the transposed view, strides (1, 10)."""
    return draw_offset_grid(strides=(1, 10), shape=(10, 4), view="x.T", base="x")


def draw_program_order(num_pid_m: int = 7, num_pid_n: int = 6, group_m: int = 3,
                       wave: int = 9, fig=None):
    """C's tiles numbered by the program that computes them: row-major against grouped order.

    The first ``wave`` programs (those that run at the same time) are shaded; each panel's title
    counts the A row bands plus B column bands they load (``panels_touched``).
    """
    import matplotlib.pyplot as plt

    from course_lib.kernels.matmul import panels_touched, program_tile

    if fig is None:
        fig = plt.figure(figsize=(12, 7.6))
    for n, (g, label) in enumerate(((1, "row-major"), (group_m, f"grouped, GROUP_M = {group_m}"))):
        ax = fig.add_axes([0.02 + 0.5 * n, 0.02, 0.46, 0.8])
        for pid in range(num_pid_m * num_pid_n):
            m, c = program_tile(pid, num_pid_m, num_pid_n, g)
            first = pid < wave
            _cell(ax, c, -m - 1, color="#4C72B0" if first else "white", alpha=0.75 if first
                  else 1.0, edge="0.3")
            ax.text(c + 0.5, -m - 0.5, str(pid), ha="center", va="center", fontsize=FONT,
                    color="white" if first else "0.25", weight="bold" if first else "normal")
        for r in range(g, num_pid_m, g) if g > 1 else ():   # the bands of GROUP_M tile rows
            ax.plot([0, num_pid_n], [-r, -r], color="black", lw=4)
        tiles = [program_tile(p, num_pid_m, num_pid_n, g) for p in range(wave)]
        rows, cols = len({m for m, _ in tiles}), len({c for _, c in tiles})
        assert rows + cols == panels_touched(num_pid_m, num_pid_n, g, wave)
        ax.set_title(f"{label}\nfirst {wave} programs: {rows} A bands + {cols} B bands "
                     f"= {rows + cols}", fontsize=FONT + 1)
        ax.set(xlim=(-0.1, num_pid_n + 0.1), ylim=(-num_pid_m - 0.1, 0.1), aspect="equal")
        _blank(ax)
    fig.suptitle(f"C as {num_pid_m} × {num_pid_n} tiles, each numbered by the pid that "
                 f"computes it", fontsize=FONT + 1, y=0.99)
    return fig


def program_order_figure():
    """The static figure of lesson 03: 7 × 6 tiles, GROUP_M = 3 (the last band holds one row of
    tiles), a wave of 9 programs."""
    return draw_program_order()


FIGURES = {
    "00_launch_1d": launch_1d_figure,
    "00_offset_grid": offset_grid_figure,
    "03_pointer_walk": pointer_walk_figure,
    "03_offset_grid_transposed": offset_grid_transposed_figure,
    "03_program_order": program_order_figure,
}
