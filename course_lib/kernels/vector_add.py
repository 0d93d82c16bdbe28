"""The smallest Triton kernel: z = x + y, one program per BLOCK_SIZE elements.

Introduced in notebooks/00_setup.ipynb. It shows the anatomy every later kernel shares:
program id -> offsets -> masked load -> compute -> masked store, and a wrapper that checks
inputs and launches a grid of ``triton.cdiv(n, BLOCK_SIZE)`` programs.

Speed: not benchmarked. It reads two numbers and writes one per element, so on a GPU it runs at
memory bandwidth; it is here for its shape, not its speed.
"""
import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE, refuse_bf16_in_interpreter


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, z_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements  # the last block may hang over the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(z_ptr + offsets, x + y, mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, block_size: int = 1024) -> torch.Tensor:
    """x + y by a Triton kernel, on the course's device (GPU, or the interpreter on CPU)."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != DEVICE:
            raise ValueError(f"{name} is on {t.device}; the course's kernels run on {DEVICE!r}")
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must share a dtype, got {x.dtype} and {y.dtype}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    refuse_bf16_in_interpreter(x, y, names=("x", "y"))
    x, y = x.contiguous(), y.contiguous()
    z = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)
    _vector_add_kernel[grid](x, y, z, n, BLOCK_SIZE=block_size)
    return z
