"""Exercises of notebooks/02b_triton_puzzles.ipynb: nine Triton puzzles, from a masked load to
a launch.

Introduced in notebooks/02b_triton_puzzles.ipynb, a warm-up before lesson 03's matmul kernel.
The idea is Sasha Rush's Triton-Puzzles (https://github.com/srush/Triton-Puzzles): a spec in
plain PyTorch, a kernel with its key lines blank, one check call. These puzzles are the
course's own, in small steps:

1. ``puzzle_scale``: a masked load and store in one program, y = scale · x;
2. ``puzzle_mul``: the program id and a program's offsets, z = x · y in blocks;
3. ``puzzle_outer``: two vectors broadcast into a 2-D block, z = x ⊗ y;
4. ``puzzle_tile``: one program per tile, 2-D offsets through strides, masked on both edges;
5. ``puzzle_strides``: z = x + y when each tensor has its own layout (a transposed view, a
   slice of a wider matrix): only the strides make it right;
6. ``puzzle_row_sum``: a reduction, ``tl.sum`` along the rows, with a masked tail;
7. ``puzzle_softmax``: a safe row softmax; the masked lanes neither win the max nor add to
   the sum;
8. ``puzzle_dot``: a (16 × K) · (K × 16) product with ``tl.dot``, K in blocks of 16;
9. ``puzzle_launch`` (Python): the launch of puzzle 5's kernel: the grid and the strides.

Every checker runs the student's kernel in the interpreter with each load and store checked
(``sandbox``), then compiled on a GPU where there is one, on cases chosen so that the classic
mistakes fail: lengths that are not a multiple of the block, non-square matrices, a transposed
view, a slice. A masked-off lane of a load without ``other=`` reads NaN there, as undefined as
on a GPU (``sandbox.guarded``'s ``undefined``). A failure names the output and the case, says
where yours and the expected output differ (the elements never written, a map of a small
matrix), and recognises the registered mistakes by their signature. ``SPECS`` holds each
puzzle's spec, as the notebook shows it.
"""
from __future__ import annotations

import inspect

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib.exercises import (
    KERNEL_NUDGES,
    TODO,
    Exercise,
    Mistake,
    Result,
    _nudge,
    _report,
    check_kernel,
    poisoned,
    register,
    sandbox,
)
from course_lib.exercises.sandbox import kernel_variant

LESSON = "02b_triton_puzzles"


# ==============================================================================================
# The specs: what each puzzle computes, in plain PyTorch (the notebook shows the same text)
# ==============================================================================================

def spec_scale(x, scale):
    return scale * x


def spec_mul(x, y):
    return x * y


def spec_outer(x, y):
    return torch.outer(x, y)


def spec_square(x):
    return x * x


def spec_add(x, y):
    return x + y


def spec_row_sum(x):
    return x.sum(dim=1)


def spec_softmax(x):
    return torch.softmax(x, dim=1)


def spec_dot(a, b):
    return a.float() @ b.float()


SPECS = {"puzzle_scale": spec_scale, "puzzle_mul": spec_mul, "puzzle_outer": spec_outer,
         "puzzle_tile": spec_square, "puzzle_strides": spec_add, "puzzle_row_sum": spec_row_sum,
         "puzzle_softmax": spec_softmax, "puzzle_dot": spec_dot, "puzzle_launch": spec_add}


# ==============================================================================================
# What the checkers say about outputs that differ
# ==============================================================================================

def _cpu(t) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def _ranges(idx) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0–2, 5, 7–8'."""
    idx = [int(i) for i in idx]
    parts, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            parts.append(f"{start}" if start == i else f"{start}–{i}")
            start = None
    return ", ".join(parts)


def unwritten_1d(name: str, got, block: int | None = None) -> str:
    """What a 1-D output that is still NaN in places says: which elements were never written."""
    g = _cpu(got)
    nan = np.isnan(g)
    if not nan.any():
        return ""
    if nan.all():
        return f"nothing was written to {name}: every element is still NaN."
    written = np.flatnonzero(~nan)
    if block and len(g) > block and written.tolist() == list(range(min(block, len(g)))):
        return (f"only the first block of {name}, elements 0–{block - 1}, was written: the "
                "other programs wrote nowhere else.")
    return f"elements {_ranges(np.flatnonzero(nan))} of {name} were never written (still NaN)."


def unwritten_2d(name: str, got) -> str:
    """Rows or columns of a 2-D output that no program wrote."""
    g = _cpu(got)
    nan = np.isnan(g)
    if not nan.any():
        return ""
    if nan.all():
        return f"nothing was written to {name}: every element is still NaN."
    parts = []
    rows, cols = np.flatnonzero(nan.all(axis=1)), np.flatnonzero(nan.all(axis=0))
    if len(rows):
        parts.append(f"row{'s' * (len(rows) > 1)} {_ranges(rows)} (every column)")
    if len(cols):
        parts.append(f"column{'s' * (len(cols) > 1)} {_ranges(cols)} (every row)")
    if not parts:
        parts.append(f"{int(nan.sum())} elements scattered over the matrix")
    return f"never written in {name}: " + " and ".join(parts) + "."


def diff_map(name: str, got, want, rtol: float, atol: float, max_rows: int = 16,
             max_cols: int = 48) -> str:
    """A picture of where a small 2-D output is wrong: '.' right, 'x' wrong, '?' never
    written (NaN); rows down, columns across."""
    g, w = _cpu(got), _cpu(want)
    if g.ndim != 2 or g.shape != w.shape or g.shape[0] > max_rows or g.shape[1] > max_cols:
        return ""
    ok = np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    rows = ["".join("." if o else ("?" if np.isnan(v) else "x") for o, v in zip(orow, grow))
            for orow, grow in zip(ok, g)]
    return (f"where {name} differs ({g.shape[0]} rows × {g.shape[1]} columns; . right, x wrong, "
            "? never written):\n      " + "\n      ".join(rows))


def _signature(got, wrong, rtol=1e-4, atol=1e-5) -> bool:
    """True when ``got`` equals what a known mistake produces (``wrong``, a NumPy array)."""
    g = _cpu(got)
    return g.shape == wrong.shape and bool(np.allclose(g, wrong, rtol=rtol, atol=atol))


#: What a NaN that no registered signature explains may come from, in a reduction.
UNDEFINED = ("computed from a lane masked off without other=: such a lane reads an undefined "
             "value (NaN in this sandbox, whatever a register held on a GPU), and a sum, a max "
             "or a dot product takes it in")


def _check(name, kernel, prepare, spec, cases, hints, nudges=None, explain=None, names=None,
           rtol=1e-5, atol=1e-6, show=True, describe=None) -> Result:
    """``check_kernel``, with this lesson's nudges before the generic ones (a nudge that knows
    the puzzle beats 'a load without a mask'), and a masked lane of a load without ``other=``
    reading NaN, as undefined as on a GPU."""
    # the generic nudges are silenced here and given below, after this puzzle's own: one nudge
    res = check_kernel(name, kernel, prepare, spec, cases, hints=(), rtol=rtol, atol=atol,
                       show=False, describe=describe, names=names, explain=explain,
                       undefined=float("nan"), nudges={k: "" for k in KERNEL_NUDGES})
    if res.status == "wrong" and "@triton.jit kernel" not in res.message:
        mine = dict(nudges or {})
        mine.update({k: v for k, v in KERNEL_NUDGES.items() if k not in mine})
        nudge = _nudge(name, hints, res.message, mine)
        more = f" More: hint('{name}')."
        if nudge and res.message.endswith(more):  # the diagnosis's pointer: the nudge has one
            res.message = res.message[:-len(more)]
        res.message += nudge
    return _report(res, show)


# ==============================================================================================
# Puzzle 1: a masked load and store (one program)
# ==============================================================================================

@triton.jit
def scale_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    # y = scale * x for a vector of n <= BLOCK elements: one program does it all
    offs = tl.arange(0, BLOCK)                       # the lanes 0, 1, ..., BLOCK - 1
    mask = ...  # TODO: True for the lanes that hold an element of x
    x = ...  # TODO: load x, only where the mask is True
    ...  # TODO: store scale * x into y, only where the mask is True


@triton.jit
def _scale_solution(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)                       # the lanes 0, 1, ..., BLOCK - 1
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, scale * x, mask=mask)


# Each registered wrong answer is the reference with one slip (``kernel_variant``).
_scale_load_unmasked = kernel_variant(
    _scale_solution, ("x = tl.load(x_ptr + offs, mask=mask)", "x = tl.load(x_ptr + offs)"))
_scale_one_lane_too_many = kernel_variant(_scale_solution, ("offs < n", "offs <= n"))
_scale_store_unmasked = kernel_variant(_scale_solution, ("scale * x, mask=mask)", "scale * x)"))
_scale_into_x = kernel_variant(_scale_solution, ("tl.store(y_ptr", "tl.store(x_ptr"))


SCALE_BLOCK = 32


def prepare_scale(x, scale):
    """One program, BLOCK = 32 lanes, y poisoned."""
    y = poisoned(x.numel(), like=x)
    args = dict(x_ptr=x, y_ptr=y, n=x.numel(), scale=scale, BLOCK=SCALE_BLOCK)
    return (1,), args, y


SCALE_HINTS = (
    "tl.arange(0, BLOCK) has BLOCK lanes, and x has only n elements: the lanes from n on must "
    "neither read nor write. The mask is a vector of BLOCK booleans, one per lane.",
    "compare the lanes' indices with the length n of the vector (not with BLOCK, which every "
    "lane is below). Mind < against <=: the last element is x[n - 1].",
    "tl.load(pointers, mask=m) reads the lanes where m is True; tl.store(pointers, values, "
    "mask=m) writes them. Pointers are the tensor's pointer plus the lanes' offsets.",
)
SCALE_NUDGES = {
    ": 1 of ": "exactly one lane too many got through the mask: which is the last index "
               "inside a vector of n elements?",
    "out of bounds": "lanes past the end of the vectors got through: every load and store "
                     "needs a mask, one that switches off each lane whose index is not below "
                     "the vectors' length.",
    "nothing was written to y": "y is still all NaN: does your store write to y's pointer?",
}


def _scale_cases():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, generator=gen), s) for n, s in ((20, 2.5), (1, -1.0), (32, 0.5))]


def check_scale(kernel, show: bool = True) -> Result:
    """``kernel``: your scale kernel; y = scale · x for n = 20, 1 and 32, BLOCK = 32."""
    return _check("puzzle_scale", kernel, prepare_scale, spec_scale, _scale_cases(),
                  SCALE_HINTS, SCALE_NUDGES, names=("y",), show=show,
                  explain=lambda case, got, want: unwritten_1d("y", got[0]),
                  describe=lambda c: f"n = {c[0].numel()}, scale = {c[1]}, BLOCK = "
                                     f"{SCALE_BLOCK}")


register(Exercise(
    name="puzzle_scale", lesson=LESSON, kind="triton",
    writes="a mask, a masked load and a masked store: y = scale · x in one program", lines=3,
    check=check_scale, solution=_scale_solution, stub=scale_kernel, extra=(prepare_scale,),
    mistakes=(Mistake("the load without its mask", _scale_load_unmasked,
                      "tl.load out of bounds"),
              Mistake("mask offs <= n", _scale_one_lane_too_many, "one lane too many"),
              Mistake("the store without its mask", _scale_store_unmasked,
                      "tl.store out of bounds"),
              Mistake("the result stored into x", _scale_into_x, "nothing was written to y")),
    hints=SCALE_HINTS))


# ==============================================================================================
# Puzzle 2: the program id (one program per block)
# ==============================================================================================

@triton.jit
def mul_kernel(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    # z = x * y for vectors of n elements: one program per BLOCK elements
    pid = ...  # TODO: which program this is, along axis 0
    offsets = ...  # TODO: the BLOCK indices of this program's elements
    in_range = ...  # TODO: True for the lanes inside the vectors
    x = tl.load(x_ptr + offsets, mask=in_range)
    y = tl.load(y_ptr + offsets, mask=in_range)
    tl.store(z_ptr + offsets, x * y, mask=in_range)


@triton.jit
def _mul_solution(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_range)
    y = tl.load(y_ptr + offsets, mask=in_range)
    tl.store(z_ptr + offsets, x * y, mask=in_range)


_mul_no_pid = kernel_variant(_mul_solution, ("pid * BLOCK + tl.arange", "tl.arange"))
_mul_pid_not_scaled = kernel_variant(_mul_solution, ("pid * BLOCK + ", "pid + "))
_mul_mask_with_block = kernel_variant(_mul_solution, ("offsets < n", "offsets < BLOCK"))


MUL_BLOCK = 32


def prepare_mul(x, y):
    """cdiv(n, 32) programs of BLOCK = 32 lanes, z poisoned."""
    n = x.numel()
    z = poisoned(n, like=x)
    args = dict(x_ptr=x, y_ptr=y, z_ptr=z, n=n, BLOCK=MUL_BLOCK)
    return (triton.cdiv(n, MUL_BLOCK),), args, z


MUL_HINTS = (
    "every program runs the same code; tl.program_id(axis=0) is the only thing that differs "
    "between them: 0 for the first program, 1 for the next, and so on.",
    "program p owns the elements p·BLOCK, p·BLOCK + 1, …, p·BLOCK + BLOCK − 1: a start that "
    "depends on p, plus the lanes 0 … BLOCK − 1.",
    "the last program hangs over the end when n is not a multiple of BLOCK: its lanes compare "
    "their element index with n, the length of the vectors.",
)
MUL_NUDGES = {
    "only the first block": f"the other programs' blocks did not land on elements {MUL_BLOCK}, "
                            f"{2 * MUL_BLOCK}, …: where must program p's block start?",
    "were never written": "some elements belong to no program: do consecutive programs' "
                          "blocks touch end to end, BLOCK elements apart?",
    "out of bounds": "lanes past the end of the vectors got through: what must the mask "
                     "compare each element index with?",
}


def _mul_cases():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(n, generator=gen), torch.randn(n, generator=gen)) for n in (1, 100, 257)]


def _describe_mul(c) -> str:
    programs = triton.cdiv(c[0].numel(), MUL_BLOCK)
    return f"n = {c[0].numel()}, BLOCK = {MUL_BLOCK}, {programs} program{'s' * (programs > 1)}"


def check_mul(kernel, show: bool = True) -> Result:
    """``kernel``: your mul kernel; z = x · y for n = 1, 100 and 257, BLOCK = 32."""
    return _check("puzzle_mul", kernel, prepare_mul, spec_mul, _mul_cases(), MUL_HINTS,
                  MUL_NUDGES, names=("z",), show=show,
                  explain=lambda case, got, want: unwritten_1d("z", got[0], MUL_BLOCK),
                  describe=_describe_mul)


register(Exercise(
    name="puzzle_mul", lesson=LESSON, kind="triton",
    writes="the program id, this program's offsets and its mask: z = x · y in blocks",
    lines=3, check=check_mul, solution=_mul_solution, stub=mul_kernel, extra=(prepare_mul,),
    mistakes=(Mistake("offsets without the program id", _mul_no_pid, "only the first block"),
              Mistake("offsets pid + arange, not pid * BLOCK + arange", _mul_pid_not_scaled,
                      "were never written"),
              Mistake("the mask compares with BLOCK, not n", _mul_mask_with_block,
                      "tl.load out of bounds")),
    hints=MUL_HINTS))


# ==============================================================================================
# Puzzle 3: broadcasting, an outer product in one 2-D block
# ==============================================================================================

@triton.jit
def outer_kernel(x_ptr, y_ptr, z_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # z[i, j] = x[i] * y[j]; z is (M, N) and row-major: z[i, j] lives at z_ptr + i * N + j
    offs_m = tl.arange(0, BLOCK_M)                   # (BLOCK_M,) the rows, BLOCK_M >= M
    offs_n = tl.arange(0, BLOCK_N)                   # (BLOCK_N,) the columns, BLOCK_N >= N
    x = tl.load(x_ptr + offs_m, mask=offs_m < M, other=0.0)      # (BLOCK_M,)
    y = tl.load(y_ptr + offs_n, mask=offs_n < N, other=0.0)      # (BLOCK_N,)
    z = ...  # TODO: the (BLOCK_M, BLOCK_N) block of products x[i] * y[j]
    z_ptrs = ...  # TODO: the (BLOCK_M, BLOCK_N) block of pointers into z
    mask = ...  # TODO: True where (i, j) lies inside the M × N output
    tl.store(z_ptrs, z, mask=mask)


@triton.jit
def _outer_solution(x_ptr, y_ptr, z_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)                   # (BLOCK_M,) the rows, BLOCK_M >= M
    offs_n = tl.arange(0, BLOCK_N)                   # (BLOCK_N,) the columns, BLOCK_N >= N
    x = tl.load(x_ptr + offs_m, mask=offs_m < M, other=0.0)      # (BLOCK_M,)
    y = tl.load(y_ptr + offs_n, mask=offs_n < N, other=0.0)      # (BLOCK_N,)
    z = x[:, None] * y[None, :]
    z_ptrs = z_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(z_ptrs, z, mask=mask)


_outer_axes_swapped = kernel_variant(
    _outer_solution, ("z = x[:, None] * y[None, :]", "z = x[None, :] * y[:, None]"))
_outer_row_length_m = kernel_variant(
    _outer_solution, ("offs_m[:, None] * N", "offs_m[:, None] * M"))
_outer_rows_only_mask = kernel_variant(
    _outer_solution, ("mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)",
                      "mask = offs_m[:, None] < M"))


def prepare_outer(x, y, block_m, block_n):
    """One program; z (M, N) row-major, poisoned."""
    M, N = x.numel(), y.numel()
    z = poisoned(M, N, like=x)
    args = dict(x_ptr=x, y_ptr=y, z_ptr=z, M=M, N=N, BLOCK_M=block_m, BLOCK_N=block_n)
    return (1,), args, z


OUTER_HINTS = (
    "v[:, None] turns a vector of length L into an (L, 1) column; v[None, :] into a (1, L) row. "
    "A column times a row broadcasts to a whole (rows, columns) block.",
    "z's row i starts N elements after row i − 1 (a row of z holds N values): the element "
    "offset of (i, j) is i times the row length, plus j. Build it as a column of row offsets "
    "plus a row of column indices.",
    "the block is BLOCK_M × BLOCK_N, larger than z: its mask needs both conditions, the row "
    "inside M and the column inside N, combined with &.",
)
OUTER_NUDGES = {
    "wrong axes": "x runs down the rows of z and y across its columns: which of the two "
                  "becomes the column, [:, None]?",
    "incompatible dimensions": "two blocks of different shapes met: the values, the pointers "
                               "and the mask must all be (BLOCK_M, BLOCK_N).",
    "never written": "part of z was never written, and some elements were written twice: how "
                     "many elements apart are two rows of z?",
    "tl.store out of bounds": "the store reaches past z: its mask must be a whole (BLOCK_M, "
                              "BLOCK_N) block, off for the lanes beyond the last row and for "
                              "those beyond the last column.",
}


def _explain_outer(case, got, want) -> str:
    x, y, bm, bn = case
    M, N = x.numel(), y.numel()
    xs, ys = _cpu(x), _cpu(y)
    swapped = np.zeros((M, N))                      # z[i, j] = x[j] * y[i], 0 outside
    for i in range(M):
        for j in range(N):
            swapped[i, j] = (xs[j] if j < M else 0.0) * (ys[i] if i < N else 0.0)
    if _signature(got[0], swapped):
        return ("z[i, j] holds x[j] · y[i]: the two vectors are broadcast along the wrong "
                "axes.")
    return "\n  ".join(p for p in (unwritten_2d("z", got[0]),
                                   diff_map("z", got[0], want[0], 1e-5, 1e-6)) if p)


def _outer_cases():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(m, generator=gen), torch.randn(n, generator=gen), bm, bn)
            for m, n, bm, bn in ((5, 12, 16, 16), (13, 7, 16, 8), (1, 16, 4, 16))]


def check_outer(kernel, show: bool = True) -> Result:
    """``kernel``: your outer-product kernel; z = x ⊗ y for (M, N) = (5, 12), (13, 7), (1, 16)."""
    return _check("puzzle_outer", kernel, prepare_outer, lambda x, y, *blocks: spec_outer(x, y),
                  _outer_cases(),
                  OUTER_HINTS, OUTER_NUDGES, explain=_explain_outer, names=("z",), show=show,
                  describe=lambda c: f"M = {c[0].numel()}, N = {c[1].numel()}, "
                                     f"BLOCK_M = {c[2]}, BLOCK_N = {c[3]}")


register(Exercise(
    name="puzzle_outer", lesson=LESSON, kind="triton",
    writes="an outer product by broadcasting: the 2-D block, its pointers and its mask",
    lines=3, check=check_outer, solution=_outer_solution, stub=outer_kernel,
    extra=(prepare_outer,),
    mistakes=(Mistake("x and y broadcast along the wrong axes", _outer_axes_swapped,
                      "wrong axes"),
              Mistake("rows M elements apart, not N", _outer_row_length_m, "never written"),
              Mistake("the mask checks the rows only", _outer_rows_only_mask,
                      "tl.store out of bounds")),
    hints=OUTER_HINTS))


# ==============================================================================================
# Layouts: a case holds a contiguous base tensor and how to view it
# ==============================================================================================

def base_for(layout: str, M: int, N: int, gen=None, fill=None) -> torch.Tensor:
    """The contiguous storage that ``view(base, layout, M, N)`` turns into an (M, N) matrix:
    "row-major" (M, N), "transposed" (N, M), "slice" (M, N + 3)."""
    shape = {"row-major": (M, N), "transposed": (N, M), "slice": (M, N + 3)}[layout]
    if fill is not None:
        return torch.full(shape, fill)
    return torch.randn(*shape, generator=gen)


def view(base: torch.Tensor, layout: str, M: int, N: int) -> torch.Tensor:
    """An (M, N) matrix over ``base``: itself, a transposed view, or columns 1 … N of a wider
    matrix (row stride N + 3)."""
    if layout == "row-major":
        return base
    if layout == "transposed":
        return base.T
    return base[:, 1:1 + N]


def layout_words(name: str, t: torch.Tensor, layout: str) -> str:
    if layout == "row-major":
        return f"{name} row-major"
    if layout == "transposed":
        return f"{name} = a transposed view (strides {tuple(t.stride())})"
    return f"{name} = columns of a wider matrix (row stride {t.stride(0)}, not N = {t.shape[1]})"


# ==============================================================================================
# Puzzle 4: a program per tile, offsets through strides, masked on both edges
# ==============================================================================================

@triton.jit
def square_kernel(x_ptr, y_ptr, M, N, stride_m, stride_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y = x * x for (M, N) matrices with the same strides:
    # x[i, j] lives at x_ptr + i * stride_m + j * stride_n (y[i, j] likewise)
    pid_m = tl.program_id(axis=0)                    # this program's row of tiles
    pid_n = tl.program_id(axis=1)                    # ... and its column of tiles
    offs_m = ...  # TODO: the BLOCK_M row indices of this tile
    offs_n = ...  # TODO: the BLOCK_N column indices of this tile
    offsets = ...  # TODO: the (BLOCK_M, BLOCK_N) block of element offsets, through the strides
    mask = ...  # TODO: True where (row, column) lies inside the M × N matrix
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x * x, mask=mask)


@triton.jit
def _square_solution(x_ptr, y_ptr, M, N, stride_m, stride_n,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(axis=0)                    # this program's row of tiles
    pid_n = tl.program_id(axis=1)                    # ... and its column of tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = offs_m[:, None] * stride_m + offs_n[None, :] * stride_n
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x * x, mask=mask)


_SQUARE_OFFSETS = "offsets = offs_m[:, None] * stride_m + offs_n[None, :] * stride_n"
_square_rows_only_mask = kernel_variant(
    _square_solution, ("mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)",
                       "mask = offs_m[:, None] < M"))
_square_no_pid_n = kernel_variant(
    _square_solution, ("offs_n = pid_n * BLOCK_N + tl.arange", "offs_n = tl.arange"))
_square_row_length_n = kernel_variant(
    _square_solution, (_SQUARE_OFFSETS, "offsets = offs_m[:, None] * N + offs_n[None, :]"))
_square_strides_swapped = kernel_variant(
    _square_solution,
    (_SQUARE_OFFSETS, "offsets = offs_m[:, None] * stride_n + offs_n[None, :] * stride_m"))


def prepare_square(x_base, layout, M, N, block_m, block_n):
    """A (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) grid; y poisoned, with x's layout."""
    x = view(x_base, layout, M, N)
    y = view(torch.full_like(x_base, float("nan")), layout, M, N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = dict(x_ptr=x, y_ptr=y, M=M, N=N, stride_m=x.stride(0), stride_n=x.stride(1),
                BLOCK_M=block_m, BLOCK_N=block_n)
    return grid, args, y


def _square_spec(x_base, layout, M, N, *blocks):
    return spec_square(view(x_base, layout, M, N))


TILE_HINTS = (
    "the launch has a 2-D grid: program (pid_m, pid_n) owns the tile of rows pid_m·BLOCK_M … "
    "and columns pid_n·BLOCK_N …, the 1-D offsets of puzzle 2 once along each axis.",
    "element (i, j) sits i·stride_m + j·stride_n elements after x[0, 0]. For a whole tile: a "
    "column of row offsets ([:, None]) plus a row of column offsets ([None, :]), as in "
    "puzzle 3, each multiplied by its stride.",
    "a tile at the bottom or right edge hangs over M or N (or both): its mask needs the row "
    "condition and the column condition, each broadcast to the tile's shape.",
)
TILE_NUDGES = {
    "row stride": "the rows of this x are further apart than N elements: the distance from "
                  "one row to the next is stride_m, whatever N is.",
    "every row)": "whole columns were never written: does offs_n depend on pid_n, the "
                  "program's column of tiles?",
    "every column)": "whole rows were never written: does offs_m depend on pid_m, the "
                     "program's row of tiles?",
    "tl.load out of bounds": "a tile's load reaches outside x. Two things keep it inside: the "
                             "offsets (each index times its own stride) and the mask (the rows "
                             "past M − 1 and the columns past N − 1 both off).",
}


def _explain_square(case, got, want) -> str:
    return "\n  ".join(p for p in (unwritten_2d("y", got[0]),
                                   diff_map("y", got[0], want[0], 1e-5, 1e-6)) if p)


def _square_cases():
    gen = torch.Generator().manual_seed(4)
    return [(base_for(layout, m, n, gen), layout, m, n, bm, bn)
            for layout, m, n, bm, bn in (("row-major", 6, 7, 4, 4), ("row-major", 10, 21, 4, 8),
                                         ("slice", 9, 13, 8, 4))]


def _describe_square(c) -> str:
    base, layout, M, N, bm, bn = c
    x = view(base, layout, M, N)
    return (f"M = {M}, N = {N}, BLOCK_M = {bm}, BLOCK_N = {bn}, "
            f"{layout_words('x and y', x, layout).replace('x and y = ', 'x and y: ')}")


def check_tile(kernel, show: bool = True) -> Result:
    """``kernel``: your square kernel; y = x · x over (6, 7), (10, 21) and a (9, 13) slice."""
    return _check("puzzle_tile", kernel, prepare_square, _square_spec, _square_cases(),
                  TILE_HINTS, TILE_NUDGES, explain=_explain_square, names=("y",), show=show,
                  describe=_describe_square)


register(Exercise(
    name="puzzle_tile", lesson=LESSON, kind="triton",
    writes="a tile's row and column indices, its offsets through the strides, its 2-D mask",
    lines=4, check=check_tile, solution=_square_solution, stub=square_kernel,
    extra=(prepare_square,),
    mistakes=(Mistake("the mask checks the rows only", _square_rows_only_mask,
                      "tl.load out of bounds"),
              Mistake("offs_n without pid_n", _square_no_pid_n, "columns 4–6"),
              Mistake("rows N elements apart, not stride_m", _square_row_length_n,
                      "row stride 16, not N = 13"),
              Mistake("the two strides swapped", _square_strides_swapped, "out of bounds")),
    hints=TILE_HINTS))


# ==============================================================================================
# Puzzle 5: each tensor through its own strides (a transposed view, a slice)
# ==============================================================================================

@triton.jit
def add_strided_kernel(x_ptr, y_ptr, z_ptr, M, N,
                       stride_xm, stride_xn, stride_ym, stride_yn, stride_zm, stride_zn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # z = x + y for (M, N) matrices, each with its own strides: any layout, no copy
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = ...  # TODO: this tile's row indices
    offs_n = ...  # TODO: this tile's column indices
    mask = ...  # TODO: True for the tile's lanes inside the M × N matrices
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask)
    y = ...  # TODO: y's tile, through y's own strides
    ...  # TODO: store x + y into z's tile, through z's strides


@triton.jit
def _add_strided_solution(x_ptr, y_ptr, z_ptr, M, N,
                          stride_xm, stride_xn, stride_ym, stride_yn, stride_zm, stride_zn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask)
    y = tl.load(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, mask=mask)
    tl.store(z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn, x + y, mask=mask)


_Y_STRIDES = "offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn"
_add_y_with_x_strides = kernel_variant(
    _add_strided_solution,
    (_Y_STRIDES, "offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn"))
_add_y_strides_swapped = kernel_variant(
    _add_strided_solution,
    (_Y_STRIDES, "offs_m[:, None] * stride_yn + offs_n[None, :] * stride_ym"))
_add_z_row_major = kernel_variant(
    _add_strided_solution,
    ("offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn",
     "offs_m[:, None] * N + offs_n[None, :]"))


def _strided_views(case):
    """x, y and z (poisoned) of a case, each in its layout, on the case's device."""
    x_base, y_base, (lx, ly, lz), M, N, _, _ = case
    z_base = base_for(lz, M, N, fill=float("nan")).to(x_base.device)
    return (view(x_base, lx, M, N), view(y_base, ly, M, N), view(z_base, lz, M, N))


def prepare_add_strided(*case):
    """A (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) grid; each tensor's strides as they are."""
    x, y, z = _strided_views(case)
    M, N, block_m, block_n = case[3:]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = dict(x_ptr=x, y_ptr=y, z_ptr=z, M=M, N=N,
                stride_xm=x.stride(0), stride_xn=x.stride(1),
                stride_ym=y.stride(0), stride_yn=y.stride(1),
                stride_zm=z.stride(0), stride_zn=z.stride(1),
                BLOCK_M=block_m, BLOCK_N=block_n)
    return grid, args, z


def _add_spec(*case):
    x, y, _ = _strided_views(case)
    return spec_add(x, y)


STRIDES_HINTS = (
    "the row and column indices and the mask are those of puzzle 4: they do not depend on the "
    "layout. Only the step from an index to an element offset does, and each tensor has its "
    "own.",
    "x's load line shows the recipe: rows times the row stride plus columns times the column "
    "stride. y and z have their own pair of strides; a transposed view has a column stride "
    "larger than its row stride.",
    "the store writes x + y through z's pointer and z's strides, with the same mask as the "
    "loads.",
)
STRIDES_NUDGES = {
    "y = a transposed view": "here y is a transposed view: its elements are not where x's are. "
                             "Does y's tile use y's strides?",
    "z = a transposed view": "here z is a transposed view: a store that assumes a row-major z "
                             "puts the sums in the wrong places. Does the store use z's strides?",
    "tl.load out of bounds": "a load reaches outside its tensor: is it masked, and does each "
                             "row index meet a row stride and each column index a column "
                             "stride?",
}


def _explain_strided(case, got, want) -> str:
    return "\n  ".join(p for p in (unwritten_2d("z", got[0]),
                                   diff_map("z", got[0], want[0], 1e-5, 1e-6)) if p)


def _strided_cases(layouts=(("row-major", "row-major", "row-major"),
                            ("row-major", "transposed", "row-major"),
                            ("slice", "row-major", "transposed")),
                   shapes=((6, 10, 4, 8), (6, 10, 4, 8), (7, 5, 4, 4))):
    gen = torch.Generator().manual_seed(5)
    return [(base_for(lx, M, N, gen), base_for(ly, M, N, gen), (lx, ly, lz), M, N, bm, bn)
            for (lx, ly, lz), (M, N, bm, bn) in zip(layouts, shapes)]


def _describe_strided(case) -> str:
    x, y, z = _strided_views(case)
    lx, ly, lz = case[2]
    M, N, bm, bn = case[3:]
    if (lx, ly, lz) == ("row-major",) * 3:
        where = "x, y and z row-major"
    else:
        where = ", ".join(layout_words(n, t, lay) for n, t, lay in
                          (("x", x, lx), ("y", y, ly), ("z", z, lz)))
    return f"M = {M}, N = {N}, BLOCK_M = {bm}, BLOCK_N = {bn}; {where}"


def check_strides(kernel, show: bool = True) -> Result:
    """``kernel``: your strided add; z = x + y with row-major tensors, then y a transposed
    view, then x a slice of a wider matrix and z a transposed view."""
    return _check("puzzle_strides", kernel, prepare_add_strided, _add_spec, _strided_cases(),
                  STRIDES_HINTS, STRIDES_NUDGES, explain=_explain_strided, names=("z",),
                  show=show, describe=_describe_strided)


register(Exercise(
    name="puzzle_strides", lesson=LESSON, kind="triton",
    writes="z = x + y through each tensor's own strides: indices, mask, y's load, z's store",
    lines=5, check=check_strides, solution=_add_strided_solution, stub=add_strided_kernel,
    extra=(prepare_add_strided,),
    mistakes=(Mistake("y loaded through x's strides", _add_y_with_x_strides,
                      "y = a transposed view"),
              Mistake("y's two strides swapped", _add_y_strides_swapped,
                      "tl.load out of bounds"),
              Mistake("z stored as if row-major", _add_z_row_major, "z = a transposed view")),
    hints=STRIDES_HINTS))


# ==============================================================================================
# Puzzle 6: a reduction, row sums with a masked tail
# ==============================================================================================

@triton.jit
def row_sum_kernel(x_ptr, out_ptr, M, N, stride_m, stride_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[i] = x[i, 0] + ... + x[i, N - 1]; one program per BLOCK_M rows, and BLOCK_N >= N
    pid_m = tl.program_id(axis=0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # this program's rows
    cols = tl.arange(0, BLOCK_N)                            # every column, and a tail past N
    row_ok = rows < M
    col_ok = cols < N
    x = ...  # TODO: the (BLOCK_M, BLOCK_N) tile of x; lanes outside x must add nothing
    sums = ...  # TODO: one sum per row of the tile
    ...  # TODO: store the sums into out, for the rows inside x only


@triton.jit
def _row_sum_solution(x_ptr, out_ptr, M, N, stride_m, stride_n,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(axis=0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # this program's rows
    cols = tl.arange(0, BLOCK_N)                            # every column, and a tail past N
    row_ok = rows < M
    col_ok = cols < N
    ptrs = x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    sums = tl.sum(x, axis=1)
    tl.store(out_ptr + rows, sums, mask=row_ok)


_row_sum_wrong_axis = kernel_variant(
    _row_sum_solution, ("tl.sum(x, axis=1)", "tl.sum(x, axis=0)"))
_row_sum_rows_only_mask = kernel_variant(
    _row_sum_solution, ("mask=row_ok[:, None] & col_ok[None, :]", "mask=row_ok[:, None]"))
_row_sum_no_column_stride = kernel_variant(
    _row_sum_solution, ("cols[None, :] * stride_n", "cols[None, :]"))
_row_sum_store_unmasked = kernel_variant(_row_sum_solution, ("sums, mask=row_ok)", "sums)"))
_row_sum_no_other = kernel_variant(_row_sum_solution, (", other=0.0)", ")"))


def prepare_row_sum(x_base, layout, M, N, block_m, block_n):
    """cdiv(M, BLOCK_M) programs; out (M,) poisoned."""
    x = view(x_base, layout, M, N)
    out = poisoned(M, like=x)
    args = dict(x_ptr=x, out_ptr=out, M=M, N=N, stride_m=x.stride(0), stride_n=x.stride(1),
                BLOCK_M=block_m, BLOCK_N=block_n)
    return (triton.cdiv(M, block_m),), args, out


def _row_sum_spec(x_base, layout, M, N, *blocks):
    return spec_row_sum(view(x_base, layout, M, N))


ROW_SUM_HINTS = (
    "the tile's pointers are puzzle 4's, with rows and cols: row indices down ([:, None]) "
    "times the row stride, column indices across ([None, :]) times the column stride.",
    "its mask combines row_ok and col_ok, broadcast like the pointers. A lane that is masked "
    "off must add nothing to a sum: tl.load's other= gives the value such lanes read.",
    "tl.sum(t, axis=a) adds t along axis a and removes that axis: axis 0 runs down the rows "
    "(one result per column), axis 1 across the columns (one result per row).",
)
ROW_SUM_NUDGES = {
    "column sums": "those are sums down the columns of each tile: which axis of the tile runs "
                   "across a row?",
    "x = a transposed view": "here x is a transposed view: the next element of a row is "
                             "stride_n elements further, not 1.",
    "tl.load out of bounds": "the load reaches past x: the lanes past column N − 1 must be "
                             "masked off too (and read a value that adds nothing).",
    "incompatible dimensions": "a block of the wrong shape reached the store: the sums must be "
                               "one value per row of the tile, BLOCK_M of them.",
    "without other=": "a lane past the edge takes part in the sum: tl.load's other= sets the "
                      "value it reads, and it must add nothing.",
}


def _explain_row_sum(case, got, want) -> str:
    x_base, layout, M, N, bm, bn = case
    x = _cpu(view(x_base, layout, M, N))
    cols = np.zeros(M)                               # what tl.sum(x, axis=0) stores: column sums
    for r in range(M):
        start, c = (r // bm) * bm, r % bm
        cols[r] = x[start:min(start + bm, M), c].sum() if c < N else 0.0
    if _signature(got[0], cols):
        return ("out holds column sums: out[i] is the sum down column i % BLOCK_M of its "
                "program's tile.")
    nan = np.flatnonzero(np.isnan(_cpu(got[0])))
    if len(nan):
        return f"out[{_ranges(nan)}] is NaN: never written, or {UNDEFINED}."
    return ""


def _row_sum_cases():
    gen = torch.Generator().manual_seed(6)
    return [(base_for(layout, m, n, gen), layout, m, n, bm, bn)
            for layout, m, n, bm, bn in (("row-major", 5, 12, 16, 16),
                                         ("row-major", 37, 50, 8, 64),
                                         ("transposed", 6, 9, 4, 16))]


def _describe_row_sum(c) -> str:
    base, layout, M, N, bm, bn = c
    x = view(base, layout, M, N)
    return f"M = {M}, N = {N}, BLOCK_M = {bm}, BLOCK_N = {bn}; {layout_words('x', x, layout)}"


def check_row_sum(kernel, show: bool = True) -> Result:
    """``kernel``: your row-sum kernel; out = x.sum(dim=1) for (5, 12), (37, 50) and a
    transposed (6, 9) view."""
    return _check("puzzle_row_sum", kernel, prepare_row_sum, _row_sum_spec, _row_sum_cases(),
                  ROW_SUM_HINTS, ROW_SUM_NUDGES, explain=_explain_row_sum, names=("out",),
                  rtol=1e-5, atol=1e-5, show=show, describe=_describe_row_sum)


register(Exercise(
    name="puzzle_row_sum", lesson=LESSON, kind="triton",
    writes="a masked 2-D load that adds nothing past the edge, tl.sum per row, a masked store",
    lines=3, check=check_row_sum, solution=_row_sum_solution, stub=row_sum_kernel,
    extra=(prepare_row_sum,),
    mistakes=(Mistake("tl.sum along axis 0", _row_sum_wrong_axis, "column sums"),
              Mistake("the load masks the rows only", _row_sum_rows_only_mask,
                      "tl.load out of bounds"),
              Mistake("columns 1 element apart, not stride_n", _row_sum_no_column_stride,
                      "x = a transposed view"),
              Mistake("the store without its mask", _row_sum_store_unmasked,
                      "tl.store out of bounds"),
              Mistake("the load without other=", _row_sum_no_other, "without other=")),
    hints=ROW_SUM_HINTS))


# ==============================================================================================
# Puzzle 7: a safe row softmax
# ==============================================================================================

@triton.jit
def softmax_kernel(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK_N: tl.constexpr):
    # y[i, :] = softmax(x[i, :]) for an (M, N) matrix; one program per row, and BLOCK_N >= N
    row = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = ...  # TODO: load this row of x; the lanes past N must never win the max
    row_max = ...  # TODO: the row's largest score
    num = ...  # TODO: e to the power of each score minus the max
    den = ...  # TODO: the row's sum of num (the lanes past N add nothing)
    tl.store(y_ptr + row * stride_y + cols, num / den, mask=inside)


@triton.jit
def _softmax_solution(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=-float("inf"))
    row_max = tl.max(x, axis=0)
    num = tl.exp(x - row_max)
    den = tl.sum(num, axis=0)
    tl.store(y_ptr + row * stride_y + cols, num / den, mask=inside)


_SOFTMAX_OTHER = 'other=-float("inf")'
_softmax_no_max = kernel_variant(_softmax_solution, ("tl.exp(x - row_max)", "tl.exp(x)"))
_softmax_other_zero = kernel_variant(_softmax_solution, (_SOFTMAX_OTHER, "other=0.0"))
_softmax_zero_wins_the_max = kernel_variant(
    _softmax_solution, (_SOFTMAX_OTHER, "other=0.0"),
    ("tl.sum(num, axis=0)", "tl.sum(tl.where(inside, num, 0.0), axis=0)"))
_softmax_store_unmasked = kernel_variant(
    _softmax_solution, ("num / den, mask=inside)", "num / den)"))
_softmax_no_other = kernel_variant(_softmax_solution, (", " + _SOFTMAX_OTHER, ""))


def prepare_softmax(x, block_n):
    """M programs, one per row; y (M, N) poisoned."""
    M, N = x.shape
    y = poisoned(M, N, like=x)
    args = dict(x_ptr=x, y_ptr=y, N=N, stride_x=x.stride(0), stride_y=y.stride(0),
                BLOCK_N=block_n)
    return (M,), args, y


def _softmax_spec(x, block_n):
    return spec_softmax(x.double()).float()


SOFTMAX_HINTS = (
    "the safe softmax of lesson 01: e^(x − max) / Σ e^(x − max). Subtracting the row's max "
    "keeps every exponent ≤ 0, so nothing overflows.",
    "a row holds N scores in a block of BLOCK_N lanes. The lanes past N must lose the max to "
    "every real score, and then contribute e^(lane − max) = 0 to the sum: which value does that "
    "for both? tl.load's other= sets what a masked lane reads.",
    "tl.max(t, axis=0) and tl.sum(t, axis=0) reduce a 1-D block to one number; tl.exp is e to "
    "the power, lane by lane.",
)
SOFTMAX_NUDGES = {
    "overflowed": "e^x overflowed: subtract the row's maximum from every score before tl.exp.",
    "underflowed": "a masked lane won the max: the lanes past N must read a value that is "
                   "smaller than every real score.",
    "in the denominator": "the lanes past N added to the sum: the value a masked lane reads "
                          "must give e^(value − max) = 0.",
    "without other=": "the lanes past N take part in the max and the sum: tl.load's other= "
                      "sets the value they read.",
}


def _explain_softmax(case, got, want) -> str:
    x = _cpu(case[0])
    g = _cpu(got[0])
    nan_rows = np.flatnonzero(np.isnan(g).any(axis=1))
    if len(nan_rows):
        r = int(nan_rows[0])
        if x[r].max() > 80:
            return (f"row {r} is NaN: its scores reach {x[r].max():.0f}, and e^x overflowed to "
                    "inf (e^89 is already inf in float32): inf / inf is NaN.")
        if x[r].max() < -80:
            return (f"row {r} is NaN: its scores lie near {x[r].mean():.0f}, and every "
                    "e^(score − max) underflowed to 0, so the row is 0 / 0: the max the program "
                    "used is far above every score of the row.")
        return f"row {r} is NaN: never written, or {UNDEFINED}."
    sums = g.sum(axis=1)
    if np.all(sums < 1 - 1e-3):
        return (f"the rows of yours sum to {sums.min():.3f} … {sums.max():.3f}, not 1: lanes "
                "past N count in the denominator.")
    return ""


def _softmax_cases():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 37, generator=gen), 64),
            (torch.randn(3, 20, generator=gen) * 3 + 100, 32),
            (torch.randn(3, 20, generator=gen) * 3 - 150, 32)]


def _describe_softmax(c) -> str:
    x, bn = c
    where = "" if abs(float(x.mean())) < 10 else f", scores near {float(x.mean()):+.0f}"
    return f"M = {x.shape[0]}, N = {x.shape[1]}, BLOCK_N = {bn}{where}"


def check_softmax(kernel, show: bool = True) -> Result:
    """``kernel``: your softmax kernel; rows of 37 and 20 scores, some near +100, some near
    −150."""
    return _check("puzzle_softmax", kernel, prepare_softmax, _softmax_spec, _softmax_cases(),
                  SOFTMAX_HINTS, SOFTMAX_NUDGES, explain=_explain_softmax, names=("y",),
                  rtol=1e-5, atol=1e-7, show=show, describe=_describe_softmax)


register(Exercise(
    name="puzzle_softmax", lesson=LESSON, kind="triton",
    writes="a safe row softmax: the load's other=, the max, the exponentials, the sum", lines=4,
    check=check_softmax, solution=_softmax_solution, stub=softmax_kernel,
    extra=(prepare_softmax,),
    mistakes=(Mistake("no max subtracted", _softmax_no_max, "overflowed"),
              Mistake("masked lanes read 0", _softmax_other_zero, "in the denominator"),
              Mistake("masked lanes read 0, kept out of the sum only",
                      _softmax_zero_wins_the_max, "underflowed"),
              Mistake("the store without its mask", _softmax_store_unmasked,
                      "tl.store out of bounds"),
              Mistake("the load without other=", _softmax_no_other, "without other=")),
    hints=SOFTMAX_HINTS))


# ==============================================================================================
# Puzzle 8: a small tl.dot, K in blocks
# ==============================================================================================

@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_K: tl.constexpr):
    # C = A @ B with A (16, K), B (K, 16) and C (16, 16), all row-major; one program
    offs_16 = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = ...  # TODO: the (16, BLOCK_K) block A[:, k0:k0 + BLOCK_K], 0 past K
        b = ...  # TODO: the (BLOCK_K, 16) block B[k0:k0 + BLOCK_K, :], 0 past K
        acc = ...  # TODO: add this step's product a @ b
    tl.store(c_ptr + offs_16[:, None] * 16 + offs_16[None, :], acc)


@triton.jit
def _dot_solution(a_ptr, b_ptr, c_ptr, K, BLOCK_K: tl.constexpr):
    offs_16 = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + offs_16[:, None] * K + ks[None, :], mask=ks[None, :] < K, other=0.0)
        b = tl.load(b_ptr + ks[:, None] * 16 + offs_16[None, :], mask=ks[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_16[:, None] * 16 + offs_16[None, :], acc)


_A_MASK, _B_MASK = "mask=ks[None, :] < K", "mask=ks[:, None] < K"
_dot_acc_overwritten = kernel_variant(_dot_solution, ("tl.dot(a, b, acc)", "tl.dot(a, b)"))
_dot_mask_without_k0 = kernel_variant(
    _dot_solution, (_A_MASK, "mask=offs_k[None, :] < K"), (_B_MASK, "mask=offs_k[:, None] < K"))
_dot_a_rows_16_apart = kernel_variant(
    _dot_solution, ("offs_16[:, None] * K", "offs_16[:, None] * 16"))
_dot_no_other = kernel_variant(
    _dot_solution, (_A_MASK + ", other=0.0", _A_MASK), (_B_MASK + ", other=0.0", _B_MASK))


DOT_BLOCK_K = 16


def prepare_dot(a, b):
    """One program; C (16, 16) in fp32, poisoned."""
    c = poisoned(16, 16, like=a, dtype=torch.float32)
    return (1,), dict(a_ptr=a, b_ptr=b, c_ptr=c, K=a.shape[1], BLOCK_K=DOT_BLOCK_K), c


def _dot_spec(a, b):
    return (a.double() @ b.double()).float()


DOT_HINTS = (
    "step k0 of the loop needs A's columns k0 … k0 + BLOCK_K − 1 (all 16 rows) and B's rows "
    "k0 … k0 + BLOCK_K − 1 (all 16 columns): 2-D blocks of pointers as in puzzle 3, with the "
    "row length of each matrix (A's rows are K long, B's 16).",
    "on the last step the K indices run past K: mask them, and let the masked lanes read 0, "
    "which adds nothing to a dot product. The mask compares the step's K indices, k0 included, "
    "with K.",
    "tl.dot(a, b) is the (16, 16) product of the two blocks; tl.dot(a, b, acc) returns "
    "acc + a @ b. The accumulator must keep the sum of every step.",
)
DOT_NUDGES = {
    "only the last": "acc must keep every step's product: each step adds to it.",
    "without other=": "on the last step the lanes past K take part in the dot product: "
                      "tl.load's other= sets the value they read, and it must add nothing.",
    "tl.load out of bounds": "a load reaches past A or B: does each block of pointers use its "
                             "matrix's row length (A's rows are K long, B's 16), and does each "
                             "mask compare this step's K indices (k0 + lane) with K?",
}


def _explain_dot(case, got, want) -> str:
    a, b = (_cpu(t) for t in case)
    K = a.shape[1]
    if np.isnan(_cpu(got[0])).any():
        return f"C is NaN: never written, or {UNDEFINED}."
    last = ((K - 1) // DOT_BLOCK_K) * DOT_BLOCK_K
    if K > DOT_BLOCK_K and _signature(got[0], a[:, last:] @ b[last:, :], rtol=1e-3, atol=1e-3):
        return (f"C holds only the last step's product, A[:, {last}:{K}] @ B[{last}:{K}, :]: "
                "the earlier steps were lost.")
    return ""


def _dot_cases():
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(16, k, generator=gen).half(), torch.randn(k, 16, generator=gen).half())
            for k in (16, 40, 70)]


def check_dot(kernel, show: bool = True) -> Result:
    """``kernel``: your dot kernel; C = A·B for K = 16, 40 and 70 (fp16 in, fp32 out)."""
    return _check("puzzle_dot", kernel, prepare_dot, _dot_spec, _dot_cases(), DOT_HINTS,
                  DOT_NUDGES, explain=_explain_dot, names=("C",), rtol=1e-3, atol=1e-3,
                  show=show, describe=lambda c: f"K = {c[0].shape[1]}, BLOCK_K = {DOT_BLOCK_K}, "
                                                f"{triton.cdiv(c[0].shape[1], DOT_BLOCK_K)} steps")


register(Exercise(
    name="puzzle_dot", lesson=LESSON, kind="triton",
    writes="A's and B's blocks for one K step, masked past K, and the tl.dot accumulation",
    lines=3, check=check_dot, solution=_dot_solution, stub=dot_kernel, extra=(prepare_dot,),
    mistakes=(Mistake("acc overwritten by each step's product", _dot_acc_overwritten,
                      "only the last"),
              Mistake("the masks compare offs_k, not k0 + offs_k, with K", _dot_mask_without_k0,
                      "tl.load out of bounds"),
              Mistake("A's rows 16 elements apart, not K", _dot_a_rows_16_apart,
                      "values differ"),
              Mistake("the loads without other=", _dot_no_other, "without other=")),
    hints=DOT_HINTS))


# ==============================================================================================
# Puzzle 9: the launch (Python)
# ==============================================================================================

def add_strided(kernel, x, y, z):
    # z = x + y with puzzle 5's kernel, for (M, N) matrices of any layout; z is allocated
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = ...  # TODO: one program per (BLOCK_M, BLOCK_N) tile of z, the ragged edges included
    ...  # TODO: kernel[grid](...): x, y, z, M, N, the two strides of x, of y, of z, the blocks
    return z


def _launch_solution(kernel, x, y, z):
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    kernel[grid](x, y, z, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                 z.stride(0), z.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return z


def _launch_floor_grid(kernel, x, y, z):
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = (M // BLOCK_M, N // BLOCK_N)
    kernel[grid](x, y, z, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                 z.stride(0), z.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return z


def _launch_row_major_strides(kernel, x, y, z):
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    kernel[grid](x, y, z, M, N, N, 1, N, 1, N, 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return z


def _launch_grid_swapped(kernel, x, y, z):
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    kernel[grid](x, y, z, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                 z.stride(0), z.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return z


def _launch_m_n_swapped(kernel, x, y, z):
    M, N = x.shape
    BLOCK_M, BLOCK_N = 8, 8
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    kernel[grid](x, y, z, N, M, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                 z.stride(0), z.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return z


class LaunchError(Exception):
    """The student's launch could not be carried out (a grid or arguments that do not fit)."""


class _Recorder:
    """Stands in for a kernel: ``recorder[grid](...)`` records the grid and the arguments
    (by the kernel's parameter names) instead of launching."""

    def __init__(self, kernel):
        self.signature = inspect.signature(sandbox.python_function(kernel))
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as exc:
                names = ", ".join(self.signature.parameters)
                raise LaunchError(f"the kernel takes ({names}); the launch gave "
                                  f"{len(args)} arguments and {sorted(kwargs) or 'no'} "
                                  f"keywords: {exc}") from None
            args = dict(bound.arguments)
            g = grid(args) if callable(grid) else grid
            g = (g,) if isinstance(g, int) else tuple(g)
            if not g or not all(isinstance(d, int) for d in g):
                raise LaunchError(f"the grid must be a tuple of ints, got {grid!r}")
            if min(g) < 0:
                raise LaunchError(f"a grid of {g}: a negative number of programs")
            self.launches.append((g, args))
        return launch


def _record(student, case):
    """The (grid, arguments) of the one launch the student's function makes for ``case``."""
    x, y, z = _strided_views(case)
    recorder = _Recorder(_add_strided_solution)
    student(recorder, x, y, z)
    if len(recorder.launches) != 1:
        raise LaunchError(f"your function launched the kernel {len(recorder.launches)} times; "
                          "it should launch it once: kernel[grid](...)")
    grid, args = recorder.launches[0]
    return grid, args, z


LAUNCH_HINTS = (
    "the kernel's first two lines are pid_m = tl.program_id(axis=0) and pid_n = "
    "tl.program_id(axis=1): the grid is a pair, the number of row tiles first, then the "
    "number of column tiles.",
    "a ragged edge still needs a program: M rows in tiles of BLOCK_M take M / BLOCK_M tiles, "
    "rounded up. triton.cdiv divides and rounds up; // rounds down.",
    "pass the arguments in the kernel's order. t.stride(0) is how many elements apart two rows "
    "of t are, t.stride(1) two columns: read them from each tensor, never assume N and 1.",
)
LAUNCH_NUDGES = {
    "the kernel takes": "count the arguments against the kernel's parameters: three tensors, "
                        "M and N, two strides for each of the three tensors, the two blocks.",
    "(every column)": "whole rows of z were never written: does the grid have enough row "
                      "tiles, the last partial one included?",
    "(every row)": "whole columns of z were never written: does the grid have enough column "
                   "tiles, in the right place of the pair?",
    "a transposed view": "here a tensor is a transposed view: its strides are not (N, 1). "
                         "Pass the strides each tensor has.",
    "tl.load out of bounds": "the kernel read outside x: are M and N, and the strides, passed "
                             "in the kernel's order?",
}


def _launch_cases():
    return _strided_cases(layouts=(("row-major", "row-major", "row-major"),
                                   ("row-major", "transposed", "row-major"),
                                   ("slice", "row-major", "transposed")),
                          shapes=((10, 21, 8, 8), (10, 21, 8, 8), (13, 6, 8, 8)))


def check_launch(student, show: bool = True) -> Result:
    """``student(kernel, x, y, z)``: your launch of puzzle 5's kernel; z = x + y for row-major
    (10, 21) matrices, then y a transposed view, then x a slice and z a transposed view."""
    name = "puzzle_launch"
    if sandbox.is_kernel(student):
        return _report(Result(name, False, "this puzzle asks for the Python function that "
                              "launches the kernel, not a @triton.jit kernel"), show)
    try:
        blank = sandbox.blanks(inspect.getsource(student))
    except (OSError, TypeError):
        blank = 0
    if blank:
        return _report(Result(name, False, TODO, "todo"), show)
    cases = _launch_cases()
    for n, case in enumerate(cases):
        try:
            _record(student, case)
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            why = f"case {n} ({_describe_strided(case)}): {type(exc).__name__}: {exc}"
            return _report(Result(name, False, why + _nudge(name, LAUNCH_HINTS, why,
                                                              LAUNCH_NUDGES)), show)
    return _check(name, _add_strided_solution, lambda *case: _record(student, case), _add_spec,
                  cases, LAUNCH_HINTS, LAUNCH_NUDGES, explain=_explain_strided, names=("z",),
                  show=show, describe=_describe_strided)


register(Exercise(
    name="puzzle_launch", lesson=LESSON, kind="python",
    writes="a launch: the grid from triton.cdiv, every tensor's strides from .stride()", lines=2,
    check=check_launch, solution=_launch_solution, stub=add_strided,
    mistakes=(Mistake("the grid rounded down", _launch_floor_grid, "rows 8–9 (every column)"),
              Mistake("strides taken as (N, 1) for every tensor", _launch_row_major_strides,
                      "y = a transposed view"),
              Mistake("the grid's two numbers swapped", _launch_grid_swapped,
                      "columns 16–20 (every row)"),
              Mistake("M and N swapped in the call", _launch_m_n_swapped,
                      "tl.load out of bounds")),
    hints=LAUNCH_HINTS))
