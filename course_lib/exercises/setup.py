"""Exercise of notebooks/00_setup.ipynb: a 2-D Triton kernel, z[i, j] = x[i, j] + b[j].

The lesson shows a 1-D kernel (vector addition); the exercise is the same ideas in two
dimensions, which the cells above do not show: a grid of (row block, column block) programs,
each owning a BLOCK_M × BLOCK_N tile of a row-major matrix. The student writes the tile's row
and column indices, the flat offsets of its elements, the mask of both edges, the load of the
bias for the tile's columns and the masked store. The checker launches the kernel itself
(``prepare_bias_rows``: the grid and the arguments) on shapes whose sides are not multiples of
the blocks, with the output poisoned, and names the classic mistakes by their signature.
"""
import torch
import triton
import triton.language as tl

from course_lib.exercises import Exercise, Mistake, check_kernel, poisoned, register
from course_lib.exercises.sandbox import kernel_variant

BLOCK_M, BLOCK_N = 16, 32


# --- what the notebook shows (tests/test_exercises.py checks the notebook has this text) ----
@triton.jit
def bias_rows_kernel(x_ptr, b_ptr, z_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(axis=0)  # which block of rows
    pid_n = tl.program_id(axis=1)  # which block of columns
    rows = ...  # TODO: the BLOCK_M row indices of this tile, a vector
    cols = ...  # TODO: the BLOCK_N column indices of this tile, a vector
    offsets = ...  # TODO: (BLOCK_M, BLOCK_N) flat offsets of the tile's elements in x and z
    mask = ...  # TODO: (BLOCK_M, BLOCK_N), True inside the matrix on both edges
    x = tl.load(x_ptr + offsets, mask=mask)
    b = ...  # TODO: the bias of the tile's columns, (BLOCK_N,)
    ...  # TODO: store x + b into z: the bias added to every row, only inside the matrix


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _bias_rows_solution(x_ptr, b_ptr, z_ptr, M, N, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(axis=0)  # which block of rows
    pid_n = tl.program_id(axis=1)  # which block of columns
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = rows[:, None] * N + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < N)
    tl.store(z_ptr + offsets, x + b[None, :], mask=mask)


# Each registered wrong answer is the reference with one slip (``kernel_variant``).
_OFFSETS = "offsets = rows[:, None] * N + cols[None, :]"
_rows_mask_only = kernel_variant(
    _bias_rows_solution, ("(cols[None, :] < N)", "(cols[None, :] < BLOCK_N * 1000)"))
_block_as_row_length = kernel_variant(
    _bias_rows_solution, (_OFFSETS, "offsets = rows[:, None] * BLOCK_N + cols[None, :]"))
_rows_as_row_length = kernel_variant(  # M: the number of rows, not their length
    _bias_rows_solution, (_OFFSETS, "offsets = rows[:, None] * M + cols[None, :]"))
_bias_by_row = kernel_variant(
    _bias_rows_solution, ("b = tl.load(b_ptr + cols, mask=cols < N)",
                          "b = tl.load(b_ptr + rows, mask=rows < N, other=0.0)"),
    ("x + b[None, :]", "x + b[:, None]"))
_no_pid_n = kernel_variant(
    _bias_rows_solution, ("cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
                          "cols = tl.arange(0, BLOCK_N)"))


def _in_torch(x, b):
    return x + b


# --- the checker -----------------------------------------------------------------------------
def prepare_bias_rows(x, b):
    """One launch: a (row block, column block) program per tile, z poisoned."""
    M, N = x.shape
    z = poisoned(M, N, like=x)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    args = dict(x_ptr=x, b_ptr=b, z_ptr=z, M=M, N=N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return grid, args, z


def _explain(case, got, want):
    """What the wrong elements of z look like: columns never written, rows a block apart, the
    bias taken by row."""
    x, b = case
    z = got[0].cpu()
    nan = torch.isnan(z)
    if nan.any() and nan.all(dim=0).any() and not nan.all():
        first = int(nan.all(dim=0).nonzero()[0])
        return (f"What it looks like: columns {first} to {z.shape[1] - 1} of z were never "
                f"written, in every row: only the first column block of each row block was "
                f"done. Which part of the column indices comes from pid_n?")
    right = torch.isclose(z, want[0].cpu(), atol=1e-6).all(dim=1)
    if z.shape[0] > 1 and right[0] and not right[1:].any():
        return ("What it looks like: row 0 of z is right and every other row is wrong: in "
                "memory the rows are N apart (the matrix's row length, the number of "
                "columns), and your offsets step from one row to the next by something else.")
    by_row = x.float() + b.float()[:x.shape[0], None] if x.shape[0] <= b.numel() else None
    if by_row is not None and torch.allclose(z[~nan], by_row[~nan], atol=1e-6):
        return ("What it looks like: row i of z got b[i] added to every element, not b[j] to "
                "column j: the bias belongs to the columns.")
    return ""


HINTS = (
    "program (pid_m, pid_n) owns rows pid_m·BLOCK_M … and columns pid_n·BLOCK_N …; each is "
    "a vector built like the 1-D kernel's offsets.",
    "a (BLOCK_M, 1) column plus a (1, BLOCK_N) row broadcast to a (BLOCK_M, BLOCK_N) block: "
    "index a vector with [:, None] or [None, :]. Element (i, j) of a row-major matrix with N "
    "columns sits at i·N + j.",
    "both edges can hang over: the mask must test the rows against M and the columns against N. "
    "The bias has one value per column: load it with the column indices and add it as a row.",
)
NUDGES = {
    "the rows are N apart": HINTS[1],
    "tl.load out of bounds": "a lane past the matrix's edge got through: does the mask test both "
                             "the rows and the columns, and the offsets use the row length N?",
    "tl.store out of bounds": "a lane past the matrix's edge got through: does the mask test "
                              "both the rows and the columns, and the offsets use the row "
                              "length N?",
}


def _cases():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(M, N, generator=gen), torch.randn(N, generator=gen))
            for M, N in ((1, 1), (37, 100), (40, 17), (16, 64))]


def check_bias_rows(kernel, show: bool = True):
    """``kernel``: your ``@triton.jit`` kernel; z = x + b[None, :] for x of shapes (1, 1),
    (37, 100), (40, 17) and (16, 64), in 16 × 32 tiles."""
    return check_kernel("bias_rows", kernel, prepare_bias_rows, lambda x, b: x + b[None, :],
                        _cases(), hints=HINTS, show=show, names=("z",), explain=_explain,
                        nudges=NUDGES,
                        describe=lambda c: f"x {tuple(c[0].shape)}, b ({c[1].numel()},)")


register(Exercise(
    name="bias_rows", lesson="00_setup", kind="triton",
    writes="a 2-D kernel: the tile's row and column indices, flat offsets, the mask of both "
           "edges, the bias load and the masked store", lines=6,
    check=check_bias_rows, solution=_bias_rows_solution, stub=bias_rows_kernel,
    extra=(prepare_bias_rows,),
    mistakes=(Mistake("a mask on the rows only", _rows_mask_only, "out of bounds"),
              Mistake("the block size as the row length", _block_as_row_length,
                      "the rows are N apart"),
              Mistake("the number of rows M as the row length", _rows_as_row_length,
                      "the rows are N apart"),
              Mistake("the bias indexed by row", _bias_by_row, "the bias belongs to the columns"),
              Mistake("column indices without pid_n", _no_pid_n, "never written, in every row"),
              Mistake("an answer in PyTorch, no kernel", _in_torch, "@triton.jit kernel")),
    hints=HINTS))
