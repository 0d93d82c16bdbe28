"""Exercises of notebooks/02_gpu_memory.ipynb and notebooks/03_tiled_matmul.ipynb.

* ``check_ridge_point(gpu, answer)``: a GPU's ridge point by hand (peak FLOP/s over bandwidth);
* ``check_read_count(m, n, k, tile, answer)``: predict how many elements a matmul reads from
  HBM, naive or tiled, before the simulator counts them;
* ``check_tiled_loop(student)``: write the tiled loop nest. The student's function gets A and
  B as ``CountingMatrix`` objects in global memory and C to write into; the checker compares C
  with A·B *and* the counted global reads with the tiled formula, so a loop that is right but
  not tiled (or tiled but wrong) is caught and told which.
"""
from __future__ import annotations

import numpy as np

from course_lib.exercises import Result, _compare, _report
from course_lib.hardware import get_gpu
from course_lib.iomodel.matmul import (
    CountingMatrix,
    Traffic,
    matmul_global_reads,
    matmul_traffic,
)


def check_ridge_point(gpu: str, answer, rel: float = 0.02) -> Result:
    """``answer``: FLOPs per byte at which ``gpu`` (fp16 tensor cores) turns compute-bound."""
    spec = get_gpu(gpu)
    want = spec.ridge_point("fp16")
    name = f"ridge point of {gpu}"
    hint = (f"peak FLOP/s divided by bytes/s: {spec.fp16_tensor_tflops:g}e12 / "
            f"{spec.hbm_tbs:g}e12")
    if answer is None:
        return _report(Result(name, False, f"no answer yet. Hint: {hint}"), True)
    if abs(float(answer) - want) <= rel * want:
        return _report(Result(name, True, f"{float(answer):.1f} FLOP/B: right "
                                          f"({want:.1f})"), True)
    return _report(Result(name, False, f"got {float(answer):.1f}, expected about {want:.1f}. "
                                       f"Hint: {hint}"), True)


def check_read_count(m: int, n: int, k: int, tile, answer) -> Result:
    """``answer``: elements of A and B read from HBM by C = A·B (``tile`` None = naive)."""
    want = matmul_global_reads(m, n, k, tile)
    what = "naive" if tile is None else f"tile {tile}"
    name = f"HBM reads, {m}×{k} · {k}×{n}, {what}"
    if tile is None:
        hint = "each of the m·n threads reads a row of A and a column of B: k elements each"
    else:
        hint = ("A is read once for every column of C tiles (⌈n/T⌉ times), B once for every "
                "row of C tiles (⌈m/T⌉ times)")
    if answer is None:
        return _report(Result(name, False, f"no answer yet. Hint: {hint}"), True)
    if int(answer) == want:
        return _report(Result(name, True, f"{want} elements: right"), True)
    t = matmul_traffic(m, n, k, tile)
    return _report(Result(name, False, f"got {answer}, expected {want} "
                                       f"(A: {t.reads_by_tensor['A']}, "
                                       f"B: {t.reads_by_tensor['B']}). Hint: {hint}"), True)


def tiled_matmul_solution(A: CountingMatrix, B: CountingMatrix, C: CountingMatrix, T: int):
    """The reference answer to the tiled-loop exercise (the notebook does not show it)."""
    M, K = A.shape
    N = B.shape[1]
    for i0 in range(0, M, T):
        for j0 in range(0, N, T):
            acc = np.zeros((min(T, M - i0), min(T, N - j0)))
            for k0 in range(0, K, T):
                a = A[i0:i0 + T, k0:k0 + T]      # one A tile: global -> shared memory
                b = B[k0:k0 + T, j0:j0 + T]      # one B tile
                acc += a @ b
            C[i0:i0 + T, j0:j0 + T] = acc


_TILED_HINT = ("for each C tile (i0, j0): acc = 0; for each k0: a = A[i0:i0+T, k0:k0+T]; "
               "b = B[k0:k0+T, j0:j0+T]; acc += a @ b; finally C[i0:i0+T, j0:j0+T] = acc")


def check_tiled_loop(student) -> Result:
    """Check ``student(A, B, C, T)``: C must equal A·B and the HBM reads must be the tiled count."""
    name = "tiled matmul loop"
    rng = np.random.default_rng(0)
    cases = ((32, 32, 32, 16), (32, 32, 32, 8), (20, 28, 24, 8), (17, 5, 9, 4), (1, 7, 3, 2))
    for m, n, k, T in cases:
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        t = Traffic()
        A = CountingMatrix(a.copy(), t, "global", "A")
        B = CountingMatrix(b.copy(), t, "global", "B")
        C = CountingMatrix(np.full((m, n), np.nan), t, "global", "C")
        where = f"{m}×{k} · {k}×{n}, T = {T}"
        try:
            student(A, B, C, T)
        except NotImplementedError:
            return _report(Result(name, False, f"not written yet. Hint: {_TILED_HINT}"), True)
        except Exception as exc:  # a student's bug is a message, not a crash
            return _report(Result(name, False, f"{where}: raised {type(exc).__name__}: {exc}. "
                                               f"Hint: {_TILED_HINT}"), True)
        if t.global_writes == 0:
            return _report(Result(name, False, f"C was never written (unfinished?). "
                                               f"Hint: {_TILED_HINT}"), True)
        why = _compare(C.data, a @ b, rtol=1e-9, atol=1e-9)
        if why:
            return _report(Result(name, False, f"{where}: C differs from A·B: {why}. "
                                               f"Hint: {_TILED_HINT}"), True)
        want = matmul_global_reads(m, n, k, T)
        if t.global_reads != want:
            return _report(Result(
                name, False, f"{where}: C is right, but the loop read {t.global_reads} elements "
                             f"from HBM (A {t.reads_by_tensor.get('A', 0)}, B "
                             f"{t.reads_by_tensor.get('B', 0)}); the tiled loop reads {want}. "
                             f"Load each tile once per phase and reuse it. Hint: {_TILED_HINT}"),
                True)
        if t.global_writes != m * n:
            return _report(Result(name, False, f"{where}: C is right, but {t.global_writes} "
                                               f"elements were written to HBM, not {m * n}: "
                                               "write each C tile once, at the end"), True)
    return _report(Result(name, True, f"all {len(cases)} cases: C = A·B, and HBM reads equal "
                                      "the tiled formula"), True)
