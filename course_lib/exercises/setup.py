"""Exercise of notebooks/00_setup.ipynb: a Triton axpy kernel (z = a·x + y)."""
import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE
from course_lib.exercises import check


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, z_ptr, a, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, a * x + y, mask=mask)


def axpy_solution(a, x, y, block_size=256):
    z = torch.empty_like(x)
    _axpy_kernel[(triton.cdiv(x.numel(), block_size),)](x, y, z, a, x.numel(),
                                                         BLOCK_SIZE=block_size)
    return z


def check_axpy(student):
    gen = torch.Generator().manual_seed(0)
    cases = [(a, torch.randn(n, generator=gen).to(DEVICE), torch.randn(n, generator=gen).to(DEVICE))
             for a, n in ((2.0, 1), (-0.5, 300), (3.0, 1025))]
    return check("axpy", student, lambda a, x, y: a * x + y, cases, rtol=1e-5, atol=1e-6,
                 hint="offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE); mask the tail; "
                      "tl.store(z_ptr + offsets, a * x + y, mask=mask)")
