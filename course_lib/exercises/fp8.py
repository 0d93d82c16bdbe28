"""The exercise of notebooks/09b_fp8.ipynb: e4m3 with one scale per block of rows.

``quantize_blocks(x, block)`` (PyTorch): round x (N, D) to e4m3 with one scale per ``block``
rows (the block's largest |x| onto 448) and scale back, against ``course_lib.fp8.fake_quantize``
(tested in tests/test_fp8.py). The cases have a last block shorter than the others and blocks
whose sizes differ by 10⁴: one scale for all of them pushes the small block below e4m3's
normal numbers, which is the point of a scale per block.

Wrong answers are the mistakes students make: one scale for the whole tensor, the scale
inverted, the rounded numbers left unscaled, a reshape that assumes N is a multiple of the block.
"""
from __future__ import annotations

import torch

from course_lib.exercises import Exercise, Mistake, Result, check, register
from course_lib.fp8 import E4M3, E4M3_MAX, fake_quantize

LESSON = "09b_fp8"


# --- what the notebook shows (tests/test_exercises.py checks the notebook has this text) -----
def quantize_blocks(x, block):
    # TODO: for each `block` rows of x (N, D), float64: the scale that maps their largest |x|
    # onto 448, the cast to torch.float8_e4m3fn, and back to float64 times the scale
    raise NotImplementedError


# --- the reference -----------------------------------------------------------------------------
def quantize_blocks_solution(x, block):
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], block):  # the last block may be shorter
        tile = x[start:start + block]
        scale = tile.abs().max() / 448.0
        out[start:start + block] = (tile / scale).to(torch.float8_e4m3fn).double() * scale
    return out


# --- the mistakes students make ----------------------------------------------------------------
def _one_scale(x, block):
    return fake_quantize(x, E4M3, per_tensor=True)


def _scale_inverted(x, block):
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], block):
        tile = x[start:start + block]
        scale = E4M3_MAX / tile.abs().max()
        out[start:start + block] = (tile / scale).to(E4M3).double() * scale
    return out


def _not_scaled_back(x, block):
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], block):
        tile = x[start:start + block]
        out[start:start + block] = (tile / (tile.abs().max() / E4M3_MAX)).to(E4M3).double()
    return out


def _reshape(x, block):
    tiles = x.reshape(-1, block, x.shape[1])  # N must be a multiple of block
    scale = tiles.abs().amax(dim=(1, 2), keepdim=True) / E4M3_MAX
    return ((tiles / scale).to(E4M3).double() * scale).reshape(x.shape)


HINTS = (
    "Work block by block: rows [start, start + block) for start = 0, block, 2·block, ... The "
    "last block can be shorter than the others.",
    "A block's scale is its largest magnitude divided by 448, so that the largest entry lands "
    "on e4m3's largest value. Divide by the scale before the cast.",
    "The cast is `.to(torch.float8_e4m3fn)`; bring the result back with `.double()` and "
    "multiply by the same scale: the answer is in x's units, not in the scaled ones.",
)


def _cases():
    gen = torch.Generator().manual_seed(9)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    mixed = randn(40, 16)
    mixed[16:32] *= 1e-4  # a block far smaller than the others: below e4m3's normals under one
    mixed[:16, 3] *= 30   # scale for all, and an outlier in the first block
    return [(randn(32, 16), 16), (randn(37, 8), 16), (mixed, 16), (randn(5, 64), 64)]


def _spec(x, block):
    return fake_quantize(x, E4M3, block)


def check_quantize_blocks(student, show: bool = True) -> Result:
    """Against ``fp8.fake_quantize(x, E4M3, block)``: exact up to float64 rounding."""
    return check("quantize_blocks", student, _spec, _cases(), hints=HINTS, rtol=1e-12,
                 atol=0.0, show=show,
                 describe=lambda c: f"x of shape {tuple(c[0].shape)}, block = {c[1]}"
                 + (", blocks of very different size" if c[0].abs().max() > 20 else ""))


register(Exercise(
    name="quantize_blocks", lesson=LESSON, kind="python",
    writes="e4m3 rounding with one scale per block of rows", lines=4,
    check=check_quantize_blocks, solution=quantize_blocks_solution, stub=quantize_blocks,
    mistakes=(Mistake("one scale for the whole tensor", _one_scale, "values differ"),
              Mistake("the scale inverted, 448 / max", _scale_inverted, "values differ"),
              Mistake("the rounded numbers left in the scaled units", _not_scaled_back,
                      "values differ"),
              Mistake("a reshape that needs N to be a multiple of block", _reshape,
                      "raised RuntimeError")),
    hints=HINTS))
