"""Lesson 02b's puzzles (course_lib.exercises.puzzles) and their pictures
(course_lib.diagrams.puzzles).

- the notebook shows each puzzle's spec as the checker uses it;
- each picture's footprint (the elements one program touches, from the offsets formula) is
  what the reference kernel really loads and stores, traced in Triton's interpreter;
- every picture draws;
- the launch puzzle turns a launch that does not fit the kernel into a message.
"""
import contextlib
import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib.diagrams import puzzles as pictures
from course_lib.exercises import puzzles, sandbox

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "02b_triton_puzzles.ipynb"


def code_cells() -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", sorted(set(puzzles.SPECS) - {"puzzle_launch"}))
def test_the_notebook_shows_each_spec(name):
    spec = textwrap.dedent(inspect.getsource(puzzles.SPECS[name])).strip()
    assert any(spec in cell for cell in code_cells()), f"no cell shows {spec!r}"


@contextlib.contextmanager
def traced():
    """Record every load and store the interpreter makes: (kind, program, addresses, mask)."""
    from triton.runtime import interpreter as ti

    builder = ti.interpreter_builder
    events = []
    real_load, real_store = builder.create_masked_load, builder.create_masked_store

    def load(ptrs, mask, other, *args, **kwargs):
        events.append(("load", tuple(builder.grid_idx), ptrs.data.copy(), mask.data.copy()))
        return real_load(ptrs, mask, other, *args, **kwargs)

    def store(ptrs, value, mask, *args, **kwargs):
        events.append(("store", tuple(builder.grid_idx), ptrs.data.copy(), mask.data.copy()))
        return real_store(ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = load, store
    try:
        yield events
    finally:  # sandbox.guarded removes the instance attributes on its way out
        builder.__dict__.pop("create_masked_load", None)
        builder.__dict__.pop("create_masked_store", None)


def touched(kernel, grid, args, tensor, kind, program) -> list[int]:
    """Element offsets of ``tensor`` (from its first element) that ``program`` accessed."""
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    with traced() as events:
        assert sandbox.run(kernel, grid, args, tensors) is None
    lo, size = tensor.data_ptr(), tensor.element_size()
    hi = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes()
    found = set()
    for k, pid, addrs, mask in events:
        if k != kind or pid[:len(program)] != program:
            continue
        addrs = np.asarray(addrs, dtype=np.int64)[np.broadcast_to(mask, addrs.shape)]
        found |= {(a - lo) // size for a in addrs.tolist() if lo <= a < hi}
    return sorted(found)


def test_vector_picture_is_what_the_kernel_touches():
    x, y = torch.randn(40), torch.randn(40)
    grid, args, z = puzzles.prepare_mul(x, y)
    for pid in range(grid[0]):
        want = pictures.block_1d(40, puzzles.MUL_BLOCK, pid)["inside"]
        assert touched(puzzles._mul_solution, grid, args, z, "store", (pid,)) == want
        assert touched(puzzles._mul_solution, grid, args, x, "load", (pid,)) == want


@pytest.mark.parametrize("layout", ["row-major", "transposed", "slice"])
def test_tile_picture_is_what_the_kernel_touches(layout):
    M, N, bm, bn = 6, 7, 4, 4
    base = puzzles.base_for(layout, M, N, torch.Generator().manual_seed(0))
    grid, args, y = puzzles.prepare_square(base, layout, M, N, bm, bn)
    x = args["x_ptr"]
    for tile in [(a, b) for a in range(grid[0]) for b in range(grid[1])]:
        fp = pictures.tile_2d(M, N, bm, bn, tile, x.stride())
        assert touched(puzzles._square_solution, grid, args, x, "load", tile) == \
            sorted(fp["offsets"])
        assert len(fp["inside"]) + len(fp["masked"]) == bm * bn


def test_rows_picture_is_what_the_kernel_touches():
    M, N, bm, bn = 6, 9, 4, 16
    base = puzzles.base_for("row-major", M, N, torch.Generator().manual_seed(0))
    grid, args, out = puzzles.prepare_row_sum(base, "row-major", M, N, bm, bn)
    for pid in range(grid[0]):
        fp = pictures.rows_block(M, N, bm, bn, pid)
        assert touched(puzzles._row_sum_solution, grid, args, args["x_ptr"], "load",
                       (pid,)) == sorted(i * N + j for i, j in fp["inside"])
        assert touched(puzzles._row_sum_solution, grid, args, out, "store", (pid,)) == \
            fp["rows"]


@pytest.mark.parametrize("draw", [
    lambda: pictures.draw_vector(40, 16, pid=2),
    lambda: pictures.draw_outer(5, 12, 8, 16),
    lambda: pictures.draw_tile(6, 7, 4, 4, (1, 1), strides=(1, 6), name="w.T"),
    lambda: pictures.draw_rows(6, 9, 4, 16, pid=1),
    lambda: pictures.draw_rows(4, 10, 1, 16, pid=2, out=None),
    lambda: pictures.draw_dot(40, 16),
    lambda: pictures.draw_launch(10, 21, 8, 8),
])
def test_pictures_draw(draw):
    import io

    buf = io.BytesIO()
    draw().savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_launch_that_does_not_fit_is_a_message():
    def too_few_arguments(kernel, x, y, z):
        kernel[(1, 1)](x, y, z, 10, 21)
        return z

    def two_launches(kernel, x, y, z):
        puzzles._launch_solution(kernel, x, y, z)
        return puzzles._launch_solution(kernel, x, y, z)

    res = puzzles.check_launch(too_few_arguments, show=False)
    assert res.status == "wrong" and "LaunchError: the kernel takes (x_ptr, y_ptr" in res.message
    res = puzzles.check_launch(two_launches, show=False)
    assert res.status == "wrong" and "launched the kernel 2 times" in res.message
    res = puzzles.check_launch(puzzles._add_strided_solution, show=False)
    assert res.status == "wrong" and "not a @triton.jit kernel" in res.message
