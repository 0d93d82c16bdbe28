"""Exercise of notebooks/00_setup.ipynb: a Triton axpy kernel, z = a·x + y.

The student writes three lines of ``axpy_kernel``: this program's offsets, the mask of the
tail, and the masked store. The checker launches the kernel itself (``prepare``: the grid and
the arguments), on lengths that are not a multiple of the block, with the output poisoned.
"""
import torch
import triton
import triton.language as tl

from course_lib.exercises import Exercise, Mistake, check_kernel, poisoned, register

BLOCK_SIZE = 128


# --- what the notebook shows (tests/test_exercises.py checks the notebook has this text) ----
@triton.jit
def axpy_kernel(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = ...  # TODO: the BLOCK_SIZE indices of this program's elements
    mask = ...  # TODO: True where an index lies inside the tensors
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    ...  # TODO: store a * x + y into z, only where the mask is True


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _axpy_solution(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, a * x + y, mask=mask)


@triton.jit
def _axpy_store_unmasked(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, a * x + y)


@triton.jit
def _axpy_no_pid(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, a * x + y, mask=mask)


@triton.jit
def _axpy_off_by_one(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets <= n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, a * x + y, mask=mask)


def _in_torch(a, x, y):
    return a * x + y


# --- the checker -----------------------------------------------------------------------------
def prepare_axpy(a, x, y):
    """One launch: one program per BLOCK_SIZE elements, z poisoned."""
    n = x.numel()
    z = poisoned(n, like=x)
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    args = dict(x_ptr=x, y_ptr=y, z_ptr=z, a=a, n_elements=n, BLOCK_SIZE=BLOCK_SIZE)
    return grid, args, z


HINTS = (
    "program pid owns the elements pid·BLOCK_SIZE … pid·BLOCK_SIZE + BLOCK_SIZE − 1; "
    "tl.arange(0, BLOCK_SIZE) is the vector 0 … BLOCK_SIZE − 1.",
    "when n_elements is not a multiple of BLOCK_SIZE, the last program hangs over the end: "
    "the mask compares each offset with n_elements.",
    "tl.store(pointer_vector, values, mask=m) writes only the lanes where m is True; the "
    "pointer vector of z is built like those of x and y.",
)


def _cases():
    gen = torch.Generator().manual_seed(0)
    return [(a, torch.randn(n, generator=gen), torch.randn(n, generator=gen))
            for a, n in ((2.0, 1), (-0.5, 300), (3.0, 1025))]


def check_axpy(kernel, show: bool = True):
    """``kernel``: your ``@triton.jit`` axpy kernel; z = a·x + y for n = 1, 300 and 1025."""
    return check_kernel("axpy", kernel, prepare_axpy, lambda a, x, y: a * x + y, _cases(),
                        hints=HINTS, show=show,
                        describe=lambda c: f"a = {c[0]}, n = {c[1].numel()}")


register(Exercise(
    name="axpy", lesson="00_setup", kind="triton",
    writes="the axpy kernel's offsets, tail mask and masked store", lines=3,
    check=check_axpy, solution=_axpy_solution, stub=axpy_kernel, extra=(prepare_axpy,),
    mistakes=(Mistake("the store without its mask", _axpy_store_unmasked, "tl.store out of bounds"),
              Mistake("offsets without pid * BLOCK_SIZE", _axpy_no_pid, "NaN"),
              Mistake("mask offsets <= n_elements", _axpy_off_by_one, "out of bounds"),
              Mistake("an answer in PyTorch, no kernel", _in_torch, "@triton.jit kernel")),
    hints=HINTS))
