"""What one Triton program touches: the pictures of notebooks/02b_triton_puzzles.ipynb.

Introduced in notebooks/02b_triton_puzzles.ipynb. Each picture draws a tensor as a grid of
cells and colours the elements that one program loads and stores; the lanes of its block that
fall outside the tensor, which the mask switches off, are drawn hatched past the edge. The 2-D
pictures add the flat memory underneath: the tensor's storage as one line of cells, and the
offsets the tile touches there (a row-major tile is a few runs of neighbours; the same tile of
a transposed view is scattered).

The footprints (``block_1d``, ``tile_2d``, ``rows_block``) are the offsets formulas of the
puzzles, ``pid * BLOCK + tl.arange(0, BLOCK)`` and ``rows * stride_m + cols * stride_n``, in
NumPy; tests/test_puzzles.py checks them against the elements the puzzles' reference kernels
really load and store, traced in Triton's interpreter. The pictures are drawn in the notebook
for the case at hand, so none is a stored image (``FIGURES`` is empty).
"""
from __future__ import annotations

import math

from course_lib.widgets.launch import MASKED, PROGRAM_COLORS

THIS = "#DD8452"          # the program's elements
OTHER = "#dbe6f3"         # elements other programs own
EDGE = "0.55"
STEP_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52")
FONT = 14
CELL_IN = 0.34            # inches per cell

FIGURES: dict = {}


# ---------------------------------------------------------------------------------------------
# Footprints: which elements one program touches, from the offsets formulas
# ---------------------------------------------------------------------------------------------

def block_1d(n: int, block: int, pid: int) -> dict:
    """Program ``pid`` of a 1-D launch over ``n`` elements: the element indices it loads and
    stores (``inside``) and its lanes past the end (``masked``, their would-be indices)."""
    offsets = [pid * block + lane for lane in range(block)]
    return {"inside": [o for o in offsets if o < n], "masked": [o for o in offsets if o >= n]}


def tile_2d(M: int, N: int, block_m: int, block_n: int, tile: tuple[int, int],
            strides: tuple[int, int] | None = None) -> dict:
    """Tile (pid_m, pid_n) of an (M, N) matrix with ``strides`` (default row-major): the
    elements inside (``inside``, as (i, j)), their offsets in memory (``offsets``,
    i·stride_m + j·stride_n) and the lanes of the tile past an edge (``masked``)."""
    s_m, s_n = strides or (N, 1)
    pid_m, pid_n = tile
    lanes = [(pid_m * block_m + a, pid_n * block_n + b)
             for a in range(block_m) for b in range(block_n)]
    inside = [(i, j) for i, j in lanes if i < M and j < N]
    return {"inside": inside, "offsets": [i * s_m + j * s_n for i, j in inside],
            "masked": [(i, j) for i, j in lanes if i >= M or j >= N]}


def rows_block(M: int, N: int, block_m: int, block_n: int, pid: int) -> dict:
    """Program ``pid`` of a row-wise kernel (row sums, softmax): BLOCK_M rows, all N columns
    in one block of BLOCK_N lanes. ``inside``/``masked`` as in ``tile_2d``; ``rows``: its rows
    inside the matrix (one output each)."""
    fp = tile_2d(M, N, block_m, block_n, (pid, 0))
    fp["rows"] = sorted({i for i, _ in fp["inside"]})
    return fp


# ---------------------------------------------------------------------------------------------
# Drawing helpers
# ---------------------------------------------------------------------------------------------

def _figure(width_cells: float, height_cells: float, cell_in: float = CELL_IN):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, width_cells * cell_in), max(1.6, height_cells * cell_in)))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_axis_off()
    return fig, ax


def _cell(ax, x, y, color="white", edge=EDGE, lw=1.0, ls="-", hatch=None, text=None,
          fontsize=FONT - 3, text_color="black"):
    """One cell with its top-left corner at (x, −y): x to the right, y down."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, -y - 1), 1, 1, facecolor=color, edgecolor=edge, lw=lw, ls=ls,
                           hatch=hatch))
    if text is not None:
        ax.text(x + 0.5, -y - 0.5, text, ha="center", va="center", fontsize=fontsize,
                color=text_color)


def _ghost(ax, x, y, edge=THIS):
    _cell(ax, x, y, color=MASKED, edge=edge, ls="--", hatch="//")


def _frame(ax, x, y, w, h, color="black", lw=2.4, ls="-"):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, -y - h), w, h, fill=False, edgecolor=color, lw=lw, ls=ls))


def _finish(ax, x0, x1, y0, y1):
    """Show the cells from column x0 to x1 and from row y0 down to row y1, with equal axes."""
    ax.set_xlim(x0, x1)
    ax.set_ylim(-y1, -y0)
    ax.set_aspect("equal")


def _legend(ax, x, y, items):
    """A row of (colour, hatch, words) swatches starting at cell (x, y)."""
    for color, hatch, words in items:
        _cell(ax, x, y, color=color, edge=THIS if hatch else EDGE, ls="--" if hatch else "-",
              hatch=hatch)
        ax.text(x + 1.3, -y - 0.5, words, va="center", fontsize=FONT - 1)
        x += 1.6 + 0.36 * len(words)


# ---------------------------------------------------------------------------------------------
# The pictures
# ---------------------------------------------------------------------------------------------

def draw_vector(n: int, block: int, pid: int = 0, name: str = "x"):
    """A 1-D launch over ``n`` elements in blocks of ``block``: every program's block, and
    program ``pid``'s elements coloured; its lanes past the end hatched."""
    programs = math.ceil(n / block)
    lanes = programs * block
    fp = block_1d(n, block, pid)
    fig, ax = _figure(lanes + 2, 7.2)
    for o in range(lanes):
        p = o // block
        if o >= n:
            _ghost(ax, o, 1, edge=THIS if p == pid else EDGE)
            continue
        _cell(ax, o, 1, color=THIS if p == pid else OTHER,
              text=str(o) if lanes <= 64 else None,
              fontsize=FONT - 3 if o < 100 else FONT - 5)
    for p in range(programs):
        _frame(ax, p * block, 1, block, 1, color="black", lw=2.4 if p == pid else 1.4)
        ax.text(p * block + block / 2, -2.75, f"program {p}", ha="center", va="center",
                fontsize=FONT, weight="bold" if p == pid else "normal",
                color=PROGRAM_COLORS[1] if p == pid else "black")
    ax.plot([n, n], [-0.6, -2.4], color="#b71c1c", lw=2.5, ls="--")
    ax.text(n, -0.35, f"n = {n}", ha="center", va="bottom", fontsize=FONT, color="#b71c1c")
    first, last = (fp["inside"][0], fp["inside"][-1]) if fp["inside"] else (None, None)
    ax.text(0, 1.9, f"{name}: n = {n}, BLOCK = {block}: {programs} program"
            f"{'s' * (programs > 1)}. Program {pid} loads and stores elements {first}–{last} "
            f"({len(fp['inside'])}); {len(fp['masked'])} of its lanes are masked off.",
            va="center", fontsize=FONT)
    _legend(ax, 0, 4.0, [(THIS, None, f"program {pid}")]
            + ([(OTHER, None, "other programs")] if programs > 1 else [])
            + [(MASKED, "//", "masked lanes (past n)")])
    _finish(ax, -0.5, lanes + 1.5, -2.6, 5.4)
    return fig


def draw_outer(M: int, N: int, block_m: int, block_n: int):
    """One program's (BLOCK_M, BLOCK_N) block over an (M, N) output: x down the left, y along
    the top, the block's lanes inside z coloured, those past M or N hatched."""
    fig, ax = _figure(block_n + 4, block_m + 7)
    top, left = 3, 2
    for a in range(block_m):                           # x, a column of BLOCK_M lanes
        (_cell(ax, 0, top + a, color=THIS, text=f"x{a}") if a < M else _ghost(ax, 0, top + a))
    for b in range(block_n):                           # y, a row of BLOCK_N lanes
        (_cell(ax, left + b, 1, color="#a6c8e0", text=f"y{b}") if b < N
         else _ghost(ax, left + b, 1))
    for a in range(block_m):
        for b in range(block_n):
            if a < M and b < N:
                _cell(ax, left + b, top + a, color=THIS)
            else:
                _ghost(ax, left + b, top + a)
    _frame(ax, left, top, N, M, color="black", lw=2.6)
    ax.text(left + N / 2, -top - M - 0.9, f"z: {M} × {N}", ha="center", va="center",
            fontsize=FONT)
    ax.text(0, 0.2, f"one program, a ({block_m}, {block_n}) block: {M * N} lanes inside z, "
            f"{block_m * block_n - M * N} masked off", va="center", fontsize=FONT)
    ax.text(0.5, -top + 0.4, "x", ha="center", fontsize=FONT, weight="bold")
    ax.text(left - 0.4, -1.5, "y", ha="right", va="center", fontsize=FONT, weight="bold")
    _finish(ax, -0.5, left + block_n + 0.5, -1.0, top + block_m + 1.6)
    return fig


def draw_tile(M: int, N: int, block_m: int, block_n: int, tile: tuple[int, int],
              strides: tuple[int, int] | None = None, name: str = "x", memory: bool = True):
    """Tile (pid_m, pid_n) of an (M, N) matrix with ``strides``: the matrix with every tile's
    outline, this tile's elements coloured and labelled with their offsets, its lanes past an
    edge hatched; below, the storage as one line of cells with the offsets it touches."""
    s_m, s_n = strides or (N, 1)
    fp = tile_2d(M, N, block_m, block_n, tile, (s_m, s_n))
    storage = (M - 1) * s_m + (N - 1) * s_n + 1
    rows_drawn = max(M, (tile[0] + 1) * block_m)
    cols_drawn = max(N, (tile[1] + 1) * block_n)
    width = max(cols_drawn, storage if memory else 0) + 1
    height = rows_drawn + (6.5 if memory else 3)
    fig, ax = _figure(width, height)
    top = 1.6
    mine = dict(zip(fp["inside"], fp["offsets"]))
    for i in range(M):
        for j in range(N):
            off = i * s_m + j * s_n
            if (i, j) in mine:
                _cell(ax, j, top + i, color=THIS, text=str(off))
            else:
                _cell(ax, j, top + i, text=str(off), text_color="0.55")
    for i, j in fp["masked"]:
        _ghost(ax, j, top + i)
    for r in range(0, M, block_m):                     # every tile's outline
        for c in range(0, N, block_n):
            _frame(ax, c, top + r, min(block_n, N - c), min(block_m, M - r), color="0.35",
                   lw=1.0, ls=(0, (4, 3)))
    _frame(ax, tile[1] * block_n, top + tile[0] * block_m, block_n, block_m, lw=2.8)
    ax.text(0, 0.6, f"{name}: {M} × {N}, strides ({s_m}, {s_n}); tile {tuple(tile)} of "
            f"{block_m} × {block_n}: {len(fp['inside'])} elements inside, "
            f"{len(fp['masked'])} lanes masked off. Each cell shows its offset "
            f"i·{s_m} + j·{s_n}.", va="center", fontsize=FONT)
    bottom = top + rows_drawn + 0.6
    if memory:
        y = bottom + 1.5
        touched = set(fp["offsets"])
        for o in range(storage):
            _cell(ax, o, y, color=THIS if o in touched else "white",
                  text=str(o), fontsize=FONT - 5 if o >= 100 else FONT - 4,
                  text_color="black" if o in touched else "0.55")
        runs = _runs(sorted(touched))
        ax.text(0, -(bottom + 0.9), f"memory: {name}'s storage as one line of {storage} elements. "
                f"The tile touches {len(touched)} of them, in {len(runs)} run"
                f"{'s' * (len(runs) != 1)} of neighbours.", va="center", fontsize=FONT)
        bottom = y + 1.4
    _finish(ax, -0.5, width, -0.2, bottom)
    return fig


def _runs(offsets) -> list[tuple[int, int]]:
    """Sorted offsets -> [(first, last)] of each run of consecutive ones."""
    runs = []
    for o in offsets:
        if runs and o == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], o)
        else:
            runs.append((o, o))
    return runs


def draw_rows(M: int, N: int, block_m: int, block_n: int, pid: int, name: str = "x",
              out: str | None = "out"):
    """Program ``pid`` of a row-wise kernel: its BLOCK_M rows across all N columns (the tail
    up to BLOCK_N hatched), and, when ``out`` is named, the outputs it writes, one per row."""
    fp = rows_block(M, N, block_m, block_n, pid)
    rows_drawn = max(M, (pid + 1) * block_m)
    gap = 2
    width = block_n + (gap + 1 if out else 0) + 1
    fig, ax = _figure(width, rows_drawn + 4)
    top = 1.6
    mine = set(fp["inside"])
    for i in range(M):
        for j in range(N):
            _cell(ax, j, top + i, color=THIS if (i, j) in mine else OTHER)
    for i, j in fp["masked"]:
        _ghost(ax, j, top + i)
    _frame(ax, 0, top, N, M, lw=2.6)
    _frame(ax, 0, top + pid * block_m, block_n, block_m, color="black", lw=2.0, ls="--")
    if out:
        x = block_n + gap
        for i in range(rows_drawn):
            if i < M:
                _cell(ax, x, top + i, color=THIS if i in fp["rows"] else OTHER)
            elif i in range(pid * block_m, (pid + 1) * block_m):
                _ghost(ax, x, top + i)
        ax.text(x + 0.5, -top + 0.4, out, ha="center", fontsize=FONT, weight="bold")
        ax.annotate("", xy=(x - 0.2, -top - pid * block_m - block_m / 2),
                    xytext=(block_n + 0.2, -top - pid * block_m - block_m / 2),
                    arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 2,
                                "mutation_scale": 18})
    what = f"{len(fp['rows'])} row{'s' * (len(fp['rows']) != 1)}"
    ax.text(0, 0.6, f"{name}: {M} × {N}; program {pid} takes {what} in one "
            f"({block_m}, {block_n}) block: {len(fp['inside'])} elements inside, "
            f"{len(fp['masked'])} lanes masked off", va="center", fontsize=FONT)
    _finish(ax, -0.5, width, -0.2, top + rows_drawn + 0.8)
    return fig


def draw_dot(K: int, block_k: int, rows: int = 16, cols: int = 16):
    """One program of C = A·B with A (rows, K), B (K, cols): the K loop's steps in colours,
    A's blocks side by side and B's stacked, the lanes past K hatched; C the accumulator."""
    steps = math.ceil(K / block_k)
    lanes = steps * block_k
    fig, ax = _figure(lanes + cols + 3, lanes + rows + 4, cell_in=0.15)
    b_left, a_top = lanes + 2, lanes + 3
    for s in range(steps):
        color = STEP_COLORS[s % len(STEP_COLORS)]
        for kk in range(s * block_k, (s + 1) * block_k):
            for r in range(rows):                      # A: rows × K, left, at the bottom
                (_cell(ax, kk, a_top + r, color=color, edge="white", lw=0.3) if kk < K
                 else _ghost(ax, kk, a_top + r, edge=EDGE))
            for c in range(cols):                      # B: K × cols, right, at the top
                (_cell(ax, b_left + c, 1 + kk, color=color, edge="white", lw=0.3) if kk < K
                 else _ghost(ax, b_left + c, 1 + kk, edge=EDGE))
        ax.text(s * block_k + block_k / 2, -a_top - rows - 1.0, f"step {s}\nk0 = {s * block_k}",
                ha="center", va="top", fontsize=FONT - 1, color=color)
    for r in range(rows):
        for c in range(cols):
            _cell(ax, b_left + c, a_top + r, color="#f3e6c4", edge="white", lw=0.3)
    _frame(ax, 0, a_top, K, rows, lw=2.2)
    _frame(ax, b_left, 1, cols, K, lw=2.2)
    _frame(ax, b_left, a_top, cols, rows, lw=2.2)
    ax.text(K / 2, -a_top + 0.6, f"A: {rows} × {K}", ha="center", fontsize=FONT)
    ax.text(b_left - 0.6, -1 - K / 2, f"B: {K} × {cols}", ha="right", va="center",
            fontsize=FONT)
    ax.text(b_left + cols / 2, -a_top - rows / 2, f"acc\n{rows} × {cols}\nfp32",
            ha="center", va="center", fontsize=FONT)
    pad = lanes - K   # on the last step: columns of a and rows of b past K
    past = (f"\nlast step: the last {pad} columns\nof a and {pad} rows of b lie past K,"
            f"\nmasked off: {rows}·{pad} + {pad}·{cols} = {(rows + cols) * pad}"
            f" lanes read 0" if pad else "\nno lane lies past K")
    ax.text(0, -1.0, f"one program, C = A·B\nK = {K} in {steps} steps of BLOCK_K = {block_k};"
            f"{past}\n\nstep s, k0 = s·{block_k}:"
            f"\n  a = A[:, k0 : k0 + {block_k}]\n  b = B[k0 : k0 + {block_k}, :]"
            f"\n  acc += a · b", va="top", fontsize=FONT)
    _finish(ax, -0.5, b_left + cols + 0.5, -1.6, a_top + rows + 3.2)
    return fig


def draw_launch(M: int, N: int, block_m: int, block_n: int):
    """The 2-D launch over an (M, N) matrix: every tile labelled with the (pid_m, pid_n) of
    the program that owns it; the lanes of the edge tiles past M or N hatched."""
    gm, gn = math.ceil(M / block_m), math.ceil(N / block_n)
    rows_drawn, cols_drawn = gm * block_m, gn * block_n
    fig, ax = _figure(cols_drawn + 1, rows_drawn + 3)
    top = 1.6
    for i in range(rows_drawn):
        for j in range(cols_drawn):
            if i < M and j < N:
                p = (i // block_m) * gn + j // block_n
                _cell(ax, j, top + i, color=PROGRAM_COLORS[p % len(PROGRAM_COLORS)],
                      edge="white", lw=0.5)
            else:
                _ghost(ax, j, top + i, edge=EDGE)
    for pm in range(gm):
        for pn in range(gn):
            _frame(ax, pn * block_n, top + pm * block_m, block_n, block_m, lw=2.2)
            h, w = min(block_m, M - pm * block_m), min(block_n, N - pn * block_n)
            ax.text(pn * block_n + w / 2, -top - pm * block_m - h / 2, f"({pm}, {pn})",
                    ha="center", va="center", fontsize=FONT + 1, weight="bold",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    ax.text(0, 0.6, f"grid = (cdiv({M}, {block_m}), cdiv({N}, {block_n})) = ({gm}, {gn}): "
            f"{gm * gn} programs; each tile shows its (pid_m, pid_n)", va="center",
            fontsize=FONT)
    _finish(ax, -0.5, cols_drawn + 0.5, -0.2, top + rows_drawn + 0.4)
    return fig
