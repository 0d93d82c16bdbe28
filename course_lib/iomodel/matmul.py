"""Memory traffic of C = A·B: a simulator that counts every access, and the closed forms.

Introduced in notebooks/03_tiled_matmul.ipynb; notebooks/02_gpu_memory.ipynb places matmuls on
the roofline with these counts.

A is (M, K), B is (K, N), C is (M, N). Two loop nests, both run element by element here on
NumPy arrays wrapped in ``CountingMatrix`` (which counts each element read or written, per
memory space), and both checked to produce A·B:

* **naive**, one thread per output: thread (i, j) reads row i of A and column j of B straight
  from global memory (HBM), K elements each, and writes C[i, j] once.
    global reads = 2·M·N·K,  global writes = M·N,  shared memory: none.
* **tiled**, one block of threads per BM×BN tile of C: for each of ⌈K/BK⌉ phases the block
  copies an A tile (BM×BK) and a B tile (BK×BN) from global into shared memory, then every
  thread of the block reads its row of the A tile and its column of the B tile from shared
  memory and accumulates in a register. Tiles hanging over the matrix edge load only the
  elements inside it (a masked load). Every element of A is therefore read once per column of
  tiles, every element of B once per row of tiles:
    global reads  = M·K·⌈N/BN⌉ + K·N·⌈M/BM⌉      (= 2·M·N·K / T for square T | M, N)
    global writes = M·N
    shared writes = global reads,  shared reads = 2·M·N·K.
  The arithmetic and the shared-memory reads are exactly the naive ones: tiling moves the
  re-reads from HBM to on-chip SRAM.

The 32×32 example of notebook 03: naive 2·32·32·32 = 65536 global reads, 16×16 tiles
65536/16 = 4096 (``matmul_global_reads(32, 32, 32, tile=16)``).

What the model leaves out, on purpose: caches (a real GPU serves many of the tiled re-reads
from L2, which is why the grouped launch order of notebook 03's Triton kernel matters),
memory transactions (32-byte sectors, not elements), and registers (a real kernel gives each
thread several outputs, so it also re-reads shared memory less). It counts what the algorithm
asks for, which is what the FlashAttention paper's IO analysis counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "CountingMatrix", "Traffic", "largest_square_tile", "matmul_compulsory_bytes",
    "matmul_flops", "matmul_global_reads", "matmul_hbm_bytes", "matmul_traffic",
    "plot_tile_sweep", "simulate_matmul", "simulate_naive", "simulate_tiled", "tile_shape",
    "tile_smem_bytes",
]


@dataclass
class Traffic:
    """Element accesses of one matmul, per memory space (elements, not bytes)."""

    global_reads: int = 0
    global_writes: int = 0
    shared_reads: int = 0
    shared_writes: int = 0
    reads_by_tensor: dict = field(default_factory=dict, compare=False)

    def global_bytes(self, bytes_per_el: int = 2) -> int:
        """Bytes moved between HBM and the chip."""
        return (self.global_reads + self.global_writes) * bytes_per_el

    def as_dict(self) -> dict:
        return {"global_reads": self.global_reads, "global_writes": self.global_writes,
                "shared_reads": self.shared_reads, "shared_writes": self.shared_writes}


class CountingMatrix:
    """A 2-D array in one memory space ('global' or 'shared'); indexing counts the elements.

    ``x[i, k]`` reads one element, ``x[i0:i1, k0:k1]`` a block (the part inside the matrix:
    NumPy slicing clips at the edge, which is what a masked load does), ``x[...] = v`` writes.
    """

    def __init__(self, data: np.ndarray, traffic: Traffic, space: str = "global",
                 name: str = ""):
        if space not in ("global", "shared"):
            raise ValueError(f"space must be 'global' or 'shared', got {space!r}")
        self.data = data
        self.traffic = traffic
        self.space = space
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def __getitem__(self, idx):
        value = self.data[idx]
        n = int(np.size(value))
        if self.space == "global":
            self.traffic.global_reads += n
            by = self.traffic.reads_by_tensor
            by[self.name] = by.get(self.name, 0) + n
        else:
            self.traffic.shared_reads += n
        return value.copy() if isinstance(value, np.ndarray) else value

    def __setitem__(self, idx, value) -> None:
        self.data[idx] = value
        n = int(np.size(self.data[idx]))
        if self.space == "global":
            self.traffic.global_writes += n
        else:
            self.traffic.shared_writes += n

    def __repr__(self) -> str:
        return f"CountingMatrix({self.name or '?'}, shape={self.shape}, space={self.space!r})"


def tile_shape(tile) -> tuple[int, int, int]:
    """(BM, BN, BK) from an int T (a T×T×T tile) or a 3-tuple."""
    if isinstance(tile, (int, np.integer)) and not isinstance(tile, bool):
        shape = (int(tile),) * 3
    elif isinstance(tile, (tuple, list)) and len(tile) == 3:
        shape = tuple(int(t) for t in tile)
    else:
        raise TypeError(f"tile must be an int or a (BM, BN, BK) tuple, got {tile!r}")
    if min(shape) < 1:
        raise ValueError(f"tile sizes must be positive, got {tile!r}")
    return shape


def _check_sizes(m, n, k) -> None:
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")


def _operands(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {a.shape}, b is {b.shape}")
    return a, b


# --------------------------------------------------------------------------------------------
# the simulator: the two loop nests, run on counting arrays
# --------------------------------------------------------------------------------------------

def simulate_naive(a, b) -> tuple[np.ndarray, Traffic]:
    """One thread per C[i, j], reading A and B from global memory. Returns (C, traffic)."""
    a, b = _operands(a, b)
    (M, K), N = a.shape, b.shape[1]
    t = Traffic()
    A = CountingMatrix(a, t, "global", "A")
    B = CountingMatrix(b, t, "global", "B")
    C = CountingMatrix(np.zeros((M, N)), t, "global", "C")
    for i in range(M):
        for j in range(N):                      # thread (i, j)
            acc = 0.0                           # a register
            for kk in range(K):
                acc += A[i, kk] * B[kk, j]      # two global reads
            C[i, j] = acc                       # one global write
    return C.data, t


def simulate_tiled(a, b, tile) -> tuple[np.ndarray, Traffic]:
    """One block per BM×BN tile of C, staging A and B tiles in shared memory.

    Returns (C, traffic). ``tile`` is T (square) or (BM, BN, BK).
    """
    a, b = _operands(a, b)
    BM, BN, BK = tile_shape(tile)
    (M, K), N = a.shape, b.shape[1]
    t = Traffic()
    A = CountingMatrix(a, t, "global", "A")
    B = CountingMatrix(b, t, "global", "B")
    C = CountingMatrix(np.zeros((M, N)), t, "global", "C")
    for i0 in range(0, M, BM):
        for j0 in range(0, N, BN):              # the block that owns C[i0:i0+BM, j0:j0+BN]
            rows, cols = min(BM, M - i0), min(BN, N - j0)
            acc = np.zeros((rows, cols))        # one register per thread
            for k0 in range(0, K, BK):          # phase: stage one A tile and one B tile
                depth = min(BK, K - k0)
                a_s = CountingMatrix(np.empty((rows, depth)), t, "shared", "A tile")
                b_s = CountingMatrix(np.empty((depth, cols)), t, "shared", "B tile")
                a_s[:, :] = A[i0:i0 + BM, k0:k0 + BK]   # global -> shared (masked at edges)
                b_s[:, :] = B[k0:k0 + BK, j0:j0 + BN]
                # __syncthreads(); then every thread (i, j) of the block:
                for i in range(rows):
                    for j in range(cols):
                        acc[i, j] += a_s[i, :] @ b_s[:, j]   # 2·depth shared reads
                # __syncthreads() before the next phase overwrites the tiles
            C[i0:i0 + rows, j0:j0 + cols] = acc
    return C.data, t


def simulate_matmul(a, b, tile=None) -> tuple[np.ndarray, Traffic]:
    """``simulate_naive`` if ``tile`` is None, else ``simulate_tiled``."""
    return simulate_naive(a, b) if tile is None else simulate_tiled(a, b, tile)


# --------------------------------------------------------------------------------------------
# closed forms
# --------------------------------------------------------------------------------------------

def matmul_traffic(m: int, n: int, k: int, tile=None) -> Traffic:
    """The simulator's counts in closed form (see the module docstring for the derivation)."""
    _check_sizes(m, n, k)
    if tile is None:
        return Traffic(global_reads=2 * m * n * k, global_writes=m * n,
                       reads_by_tensor={"A": m * n * k, "B": m * n * k})
    BM, BN, _ = tile_shape(tile)
    a_reads = m * k * math.ceil(n / BN)        # every A element once per column of C tiles
    b_reads = k * n * math.ceil(m / BM)        # every B element once per row of C tiles
    return Traffic(global_reads=a_reads + b_reads, global_writes=m * n,
                   shared_reads=2 * m * n * k, shared_writes=a_reads + b_reads,
                   reads_by_tensor={"A": a_reads, "B": b_reads})


def matmul_global_reads(m: int, n: int, k: int, tile=None) -> int:
    """Elements read from global memory (HBM): naive if ``tile`` is None, else tiled.

    >>> matmul_global_reads(32, 32, 32), matmul_global_reads(32, 32, 32, tile=16)
    (65536, 4096)
    """
    return matmul_traffic(m, n, k, tile).global_reads


def matmul_flops(m: int, n: int, k: int) -> int:
    """2·M·N·K: one multiply and one add per term of every inner product."""
    _check_sizes(m, n, k)
    return 2 * m * n * k


def matmul_hbm_bytes(m: int, n: int, k: int, tile=None, bytes_per_el: int = 2) -> int:
    """Bytes between HBM and the chip if no cache caught a re-read (reads + writes)."""
    return matmul_traffic(m, n, k, tile).global_bytes(bytes_per_el)


def matmul_compulsory_bytes(m: int, n: int, k: int, bytes_per_el: int = 2) -> int:
    """The floor: A and B read once, C written once. A tile as big as C reaches it."""
    _check_sizes(m, n, k)
    return (m * k + k * n + m * n) * bytes_per_el


def tile_smem_bytes(tile, bytes_per_el: int = 2, stages: int = 1) -> int:
    """Shared memory a block needs for one A tile and one B tile (× pipeline stages)."""
    BM, BN, BK = tile_shape(tile)
    return stages * (BM * BK + BK * BN) * bytes_per_el


def largest_square_tile(smem_bytes: float, bytes_per_el: int = 2, stages: int = 1) -> int:
    """The largest T whose T×T A tile and T×T B tile fit in ``smem_bytes``."""
    return int(math.isqrt(int(smem_bytes // (2 * bytes_per_el * stages))))


# --------------------------------------------------------------------------------------------
# the tile-size sweep
# --------------------------------------------------------------------------------------------

def plot_tile_sweep(n: int = 4096, gpus=("L4", "A100-80GB", "H100-SXM"), bytes_per_el: int = 2,
                    max_tile: int = 512, ax=None):
    """Global reads of an n×n×n matmul against the square tile size T, with the largest tile
    that fits in each GPU's shared memory (one A and one B tile, ``smem_per_block_kib``).

    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    from course_lib.hardware import get_gpu

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.8))
    tiles = np.arange(1, max_tile + 1)
    reads = np.array([matmul_global_reads(n, n, n, int(t)) for t in tiles], dtype=float)
    ax.loglog(tiles, reads, color="C0", lw=2, label=f"global reads, {n}³ matmul")
    pow2 = tiles[(tiles & (tiles - 1)) == 0]
    ax.loglog(pow2, reads[pow2 - 1], "o", color="C0", ms=5)
    floor = 2 * n * n
    ax.axhline(floor, color="0.4", ls="--", lw=1)
    ax.text(1.1, floor * 1.3, f"floor: A and B read once = {floor:.3g}", fontsize=8, color="0.3")
    ax.annotate(f"naive (T = 1): 2n³ = {reads[0]:.3g}", (1, reads[0]), xytext=(10, 2),
                textcoords="offset points", fontsize=8, va="bottom")
    styles = ["-", "--", "-.", ":"]
    limits = []
    for idx, name in enumerate(gpus):
        g = get_gpu(name)
        cap = g.smem_per_block_bytes or g.smem_per_sm_bytes
        t_max = largest_square_tile(cap, bytes_per_el)
        limits.append(t_max)
        ax.axvline(t_max, color=f"C{idx + 1}", ls=styles[idx % 4], lw=1.5,
                   label=f"{name}: {cap / 1024:g} KiB shared memory per block → T ≤ {t_max}")
    if limits:
        ax.axvspan(max(limits), max_tile, color="C3", alpha=0.08)
        ax.text(max(limits) * 1.05, reads[0] / 3, "too big for\nany GPU\nlisted",
                fontsize=8, color="C3", va="top")
    ax.set_xlim(1, max_tile)
    ax.set_xlabel(f"tile size T (A and B tiles of T×T, {bytes_per_el}-byte elements)")
    ax.set_ylabel("elements read from global memory (HBM)")
    ax.set_title(f"Global reads fall as 1/T: C = A·B with n = {n}")
    ax.set_ylim(floor / 2, reads[0] * 4)
    # above the floor's label (at 1.3× the floor, near the bottom left), clear of it
    ax.legend(fontsize=7.5, loc="lower left", bbox_to_anchor=(0, 0.16))
    ax.grid(True, which="major", alpha=0.3)
    return ax


def _tile_sweep_figure():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    plot_tile_sweep(ax=ax)
    fig.tight_layout()
    return fig


FIGURES = {"tile_sweep": _tile_sweep_figure}
"""Figures this module draws: name -> function returning a matplotlib Figure (for images/)."""
