"""Exercises of notebooks/02_gpu_memory.ipynb and notebooks/03_tiled_matmul.ipynb.

Lesson 02:

* ``ridge_point`` (Python): the FLOPs per byte at which a GPU turns compute-bound, from its
  datasheet numbers; checked on every GPU of ``course_lib.hardware``;
* ``linear_roofline`` (Python): a linear layer Y = X·Wᵀ of n tokens in fp16, counted by the
  student (FLOPs, compulsory bytes) and placed on a GPU's roofline (time floor in µs, the
  bound), against ``iomodel.matmul`` and ``roofline.classify``; a wrong answer is told which
  slip it looks like (a unit prefix, the two times added or the shorter one taken, the bound
  inverted, elements for bytes, one FLOP per multiply-add, the weights alone);
* ``q02_qk_d128`` (question): where S = QKᵀ moves on the roofline when d doubles.

Lesson 03:

* ``read_count`` (Python): how many elements the tiled kernel reads from HBM, as a function of
  M, N, K and the tile T (ragged edges included), against ``matmul_global_reads``;
* ``tiled_loop`` (Python): the tiled loop nest. The student's function gets A and B as
  ``CountingMatrix`` objects in global memory and C to write into; the checker compares C with
  A·B *and* the counted HBM reads and writes with the tiled formula, so a loop that is right
  but not tiled (or tiled but wrong) is caught and told which;
* ``matmul_k_loop`` (Triton): the K loop of a minimal tiled matmul kernel: B's block of
  pointers, its mask, the ``tl.dot`` accumulation in fp32, the pointer advance and the masked
  store; on ragged M, N, K with blocks of 16 (the smallest ``tl.dot`` takes);
* ``grouped_order`` (Triton): the grouped program order, a 1-D pid mapped to (pid_m, pid_n)
  GROUP_M rows of tiles at a time, against ``course_lib.kernels.matmul.program_tile``.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib.exercises import (
    TODO,
    Exercise,
    Mistake,
    Question,
    Result,
    _compare,
    _nudge,
    _report,
    check,
    check_kernel,
    poisoned,
    register,
)
from course_lib.exercises.sandbox import kernel_variant
from course_lib.hardware import GPUS
from course_lib.iomodel.matmul import CountingMatrix, Traffic, matmul_global_reads
from course_lib.kernels.matmul import program_tile

# ==============================================================================================
# Lesson 02: the ridge point
# ==============================================================================================

def ridge_point(peak_tflops, hbm_tbs):
    # TODO: the FLOPs per byte of HBM traffic at which the roofline's two ceilings meet
    raise NotImplementedError


def _ridge_point_solution(peak_tflops, hbm_tbs):
    flops_per_s = peak_tflops * 1e12        # tera = 10^12, for FLOP/s and for byte/s alike
    bytes_per_s = hbm_tbs * 1e12
    return flops_per_s / bytes_per_s


def _ridge_inverted(peak_tflops, hbm_tbs):
    return hbm_tbs / peak_tflops


def _ridge_per_element(peak_tflops, hbm_tbs):
    return 2 * peak_tflops / hbm_tbs        # FLOPs per 2-byte fp16 element, not per byte


def _ridge_units(peak_tflops, hbm_tbs):
    return peak_tflops * 1e12 / (hbm_tbs * 1e9)   # TB/s taken as 10^9 bytes per second


RIDGE_HINTS = (
    "the roofline is attainable(I) = min(P, β·I): a flat ceiling P and a slanted one β·I. The "
    "ridge point is the intensity I at which the two are equal.",
    "units: a FLOP/s divided by a byte/s is a FLOP per byte. TFLOP/s and TB/s carry the same "
    "prefix, 10^12.",
    "per byte, not per element: no factor for the size of an fp16 number.",
)


def _ridge_cases():
    return [(g.fp16_tensor_tflops, g.hbm_tbs) for g in GPUS.values() if g.hbm_tbs]


def _describe_ridge(args) -> str:
    names = [k for k, g in GPUS.items() if (g.fp16_tensor_tflops, g.hbm_tbs) == tuple(args)]
    return f"{names[0] if names else 'a GPU'}: {args[0]:g} TFLOP/s, {args[1]:g} TB/s"


def check_ridge_point(student, show: bool = True) -> Result:
    """``student(peak_tflops, hbm_tbs)``: FLOP/byte of the ridge point, on every GPU of the
    table (fp16 tensor cores), against ``GPUSpec.ridge_point``."""
    return check("ridge_point", student, lambda p, b: p / b, _ridge_cases(),
                 hints=RIDGE_HINTS, rtol=1e-6, atol=0.0, show=show, describe=_describe_ridge)


register(Exercise(
    name="ridge_point", lesson="02_gpu_memory", kind="python",
    writes="a GPU's ridge point from its peak TFLOP/s and its TB/s", lines=3,
    check=check_ridge_point, solution=_ridge_point_solution, stub=ridge_point,
    mistakes=(Mistake("bandwidth over compute (bytes per FLOP)", _ridge_inverted,
                      "values differ"),
              Mistake("FLOPs per fp16 element", _ridge_per_element, "values differ"),
              Mistake("TB/s as 10^9 bytes per second", _ridge_units, "values differ")),
    hints=RIDGE_HINTS))


# ==============================================================================================
# Lesson 02: a linear layer on the roofline, counted and timed by the student
# ==============================================================================================

def linear_roofline(n, d_in, d_out, peak_tflops, hbm_tbs):
    # Y = X·Wᵀ in fp16: X is n × d_in (n tokens), W is d_out × d_in, Y is n × d_out.
    # TODO: return (flops, bytes_moved, time_us, bound): the FLOPs of the product, its
    # compulsory HBM traffic in bytes, its time floor in µs on a GPU of peak_tflops TFLOP/s
    # and hbm_tbs TB/s, and "memory" or "compute", the ceiling that sets that floor
    raise NotImplementedError


def linear_roofline_solution(n, d_in, d_out, peak_tflops, hbm_tbs):
    flops = 2 * n * d_out * d_in            # n·d_out dot products of d_in terms: a mul and an add
    bytes_moved = 2 * (n * d_in + d_out * d_in + n * d_out)  # X, W read, Y written; 2 B each
    compute_s = flops / (peak_tflops * 1e12)          # tera = 10^12, for FLOP/s and byte/s
    memory_s = bytes_moved / (hbm_tbs * 1e12)
    time_us = 1e6 * max(compute_s, memory_s)          # the two overlap: the longer one is left
    bound = "compute" if compute_s >= memory_s else "memory"
    return flops, bytes_moved, time_us, bound


def _linear_as(n, d_in, d_out, peak_tflops, hbm_tbs, flops_per_term=2, bytes_per_el=2,
               weights_only=False, flop_unit=1e12, byte_unit=1e12, combine=max, per_s=1e6,
               inverted=False):
    """``linear_roofline_solution`` with one thing done wrong (each keyword, one mistake)."""
    flops = flops_per_term * n * d_out * d_in
    elements = d_out * d_in if weights_only else n * d_in + d_out * d_in + n * d_out
    bytes_moved = bytes_per_el * elements
    compute_s = flops / (peak_tflops * flop_unit)
    memory_s = bytes_moved / (hbm_tbs * byte_unit)
    time_us = per_s * combine(compute_s, memory_s)
    bound = "compute" if (compute_s >= memory_s) != inverted else "memory"
    return flops, bytes_moved, time_us, bound


def _linear_wrong(**slip):
    return lambda *case: _linear_as(*case, **slip)


def _linear_spec(n, d_in, d_out, peak_tflops, hbm_tbs):
    """The library's numbers: ``iomodel.matmul``'s count of Y (n × d_out) = X (n × d_in) · Wᵀ
    (d_in × d_out), placed on a GPU of these two ceilings by ``roofline.classify``."""
    import dataclasses

    from course_lib import roofline as rl
    from course_lib.iomodel.matmul import matmul_compulsory_bytes, matmul_flops

    gpu = dataclasses.replace(GPUS["H100-SXM"], name="a GPU", fp16_tensor_tflops=peak_tflops,
                              hbm_tbs=hbm_tbs)
    flops, nbytes = matmul_flops(n, d_out, d_in), matmul_compulsory_bytes(n, d_out, d_in)
    row = rl.classify(gpu, [("linear layer", flops, nbytes)])[0]
    return flops, nbytes, row["time_floor_us"], row["bound"]


#: (n tokens, d_in, d_out, GPU): one decoding step, a 4096-token prompt through an MLP
#: up-projection, and batches between; both sides of the ridge point, far from it and close
_LINEAR_CASES = ((1, 4096, 4096, "H100-SXM"),      # memory-bound, far left of the ridge
                 (4096, 4096, 14336, "H100-SXM"),  # compute-bound, far right
                 (128, 4096, 4096, "A100-80GB"),   # memory-bound, just left of the ridge
                 (256, 4096, 4096, "H200"),        # compute-bound, just right of it
                 (64, 8192, 1024, "L4"))           # d_in ≠ d_out, memory-bound
LINEAR_OUTPUTS = ("flops", "bytes_moved", "time_us", "bound")


def _linear_cases():
    return [(n, d_in, d_out, GPUS[k].fp16_tensor_tflops, GPUS[k].hbm_tbs)
            for n, d_in, d_out, k in _LINEAR_CASES]


def _describe_linear(case) -> str:
    n, d_in, d_out, peak, bw = case
    key = next(k for k, g in GPUS.items() if (g.fp16_tensor_tflops, g.hbm_tbs) == (peak, bw))
    return (f"n = {n}, d_in = {d_in}, d_out = {d_out} on the {key}: {peak:g} TFLOP/s, "
            f"{bw:g} TB/s")


LINEAR_HINTS = (
    "count from the definition: Y[i, j] = Σ_k X[i, k]·W[j, k]. How many entries has Y, how many "
    "terms has each sum, and how many FLOPs is one term? For the bytes: how many elements has "
    "each matrix that must cross HBM, and how many bytes is one fp16 element?",
    "two times: the FLOPs alone at the compute ceiling, and the bytes alone at the bandwidth "
    "ceiling. peak_tflops counts 10^12 FLOPs a second and hbm_tbs 10^12 bytes a second; work "
    "in seconds, then convert (1 s = 10^6 µs).",
    "the GPU computes while it moves the next bytes, so the two times overlap: the floor is the "
    "longer one, and the longer one names the bound.",
)
LINEAR_NUDGES = {  # the first key found in the message picks the nudge
    "return four values": "end with the four in this order: return flops, bytes_moved, "
                          "time_us, bound.",
    "return the string": "bound is the bare word, in lower case: \"memory\" or \"compute\" "
                         "(the figure after the check colours each point by it).",
    "flops:": LINEAR_HINTS[0],
    "bytes_moved:": LINEAR_HINTS[0],
    "time_us:": LINEAR_HINTS[1],
    "bound:": LINEAR_HINTS[2],
}

_LINEAR_TIME_SLIPS = (
    ("the two times added, not the larger one taken",
     lambda c, m: c + m,
     "the tensor cores compute while the memory streams the next bytes, so the two times "
     "overlap: the floor is the longer one, and the shorter hides under it."),
    ("the shorter of the two times",
     lambda c, m: min(c, m),
     "the roofline takes the smaller of two *speeds*, the lower ceiling. In time that is the "
     "longer of the two: the layer cannot finish before its bytes have moved, nor before its "
     "FLOPs are done."),
    ("TFLOP/s used as FLOP/s",
     lambda c, m: max(c * 1e12, m),
     "peak_tflops counts 10^12 FLOPs a second; FLOPs divided by the bare number give a "
     "compute time 10^12 times too long."),
    ("TB/s read as GB/s",
     lambda c, m: max(c, m * 1e3),
     "hbm_tbs counts 10^12 bytes a second, not 10^9; the memory time came out 1000 times too "
     "long."),
    ("the time in seconds, not µs",
     lambda c, m: max(c, m) * 1e-6,
     "time_us is in microseconds: 1 s = 10^6 µs."),
)


def _diagnose_linear(output: str, case, got, want) -> str | None:
    """What the first output that differs looks like: a registered mistake, in words."""
    n, d_in, d_out, peak, bw = case
    i = LINEAR_OUTPUTS.index(output)
    if output != "bound":
        try:
            g, w = float(got[i]), float(want[i])
        except (TypeError, ValueError):
            return None
    if output == "flops" and np.isclose(g, w / 2, rtol=1e-9):
        return ("a multiply-add counted as one FLOP: each term X[i, k]·W[j, k] of a sum is a "
                "multiply and an add, 2 FLOPs (the lesson's n × n matmul does 2n³).")
    if output == "bytes_moved":
        if np.isclose(g, w / 2, rtol=1e-9):
            return "bytes counted as elements: every fp16 number is 2 bytes."
        if np.isclose(g, 2 * d_out * d_in, rtol=1e-9):
            return ("only the weights counted: W is the largest matrix when n is small, but X "
                    "is read and Y written too, and with many tokens they are not small.")
    if output == "time_us":
        compute_s, memory_s = want[0] / (peak * 1e12), want[1] / (bw * 1e12)
        for label, slip, why in _LINEAR_TIME_SLIPS:
            if np.isclose(g, 1e6 * slip(compute_s, memory_s), rtol=1e-6):
                return f"{label}: {why}"
        k = np.log10(g / w) if math.isfinite(g) and g > 0 else None
        if k is not None and abs(k - round(k)) < 1e-6 and round(k):
            return (f"yours is 10^{round(k)} times the floor: a unit slipped (tera = 10^12, for "
                    "FLOP/s and for byte/s alike; 1 s = 10^6 µs).")
    if output == "bound" and {str(got[3]), want[3]} == {"memory", "compute"}:
        longer = "memory" if want[3] == "memory" else "compute"
        return (f"the bound the wrong way round: here the {longer} time is the longer one, so "
                f"the layer is {longer}-bound. The longer time sets the floor and names the "
                "bound (by intensity: below the ridge point is memory-bound).")
    return None


def _linear_differs(output: str, g, w) -> str | None:
    if output == "bound":
        if g == w:
            return None
        if str(g) not in ("memory", "compute"):
            return f"bound: yours {g!r}; return the string \"memory\" or \"compute\""
        return f"bound: yours {g!r}, expected {w!r}"
    try:
        gf = float(g)
    except (TypeError, ValueError):
        return f"{output}: expected a number, got {g!r}"
    if np.isclose(gf, w, rtol=1e-6, atol=0.0):
        return None

    def shown(x: float) -> str:  # a count as a whole number, a time to 6 digits
        whole = output != "time_us" and math.isfinite(x) and x == int(x)
        return f"{x:,.0f}" if whole else f"{x:.6g}"

    return f"{output}: yours {shown(gf)}, expected {shown(w)}"


def check_linear_roofline(student, show: bool = True) -> Result:
    """``student(n, d_in, d_out, peak_tflops, hbm_tbs) -> (flops, bytes_moved, time_us,
    bound)`` of Y = X·Wᵀ in fp16, against ``iomodel.matmul`` and ``roofline.classify``: one
    token and many, both sides of the ridge, four GPUs of the table. A failure names the output
    that differs and what it looks like."""
    from course_lib.exercises.diagnose import diagnosed

    name = "linear_roofline"

    def fail(message: str, what: str | None = None) -> Result:
        return diagnosed(name, Result(name, False, message), lambda _: what, LINEAR_HINTS,
                         LINEAR_NUDGES, show)

    for n, case in enumerate(_linear_cases()):
        where = f"case {n} ({_describe_linear(case)})"
        try:
            got = student(*case)
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            return fail(f"{where} raised {type(exc).__name__}: {exc}")
        if got is None:
            if n == 0:
                return _report(Result(name, False, TODO + " (it returns None)", "todo"), show)
            return fail(f"{where} returned None")
        if not isinstance(got, (tuple, list)) or len(got) != len(LINEAR_OUTPUTS):
            return fail(f"{where}: return four values, (flops, bytes_moved, time_us, bound); "
                        f"got {got!r}")
        want = _linear_spec(*case)
        for output, g, w in zip(LINEAR_OUTPUTS, got, want):
            why = _linear_differs(output, g, w)
            if why:
                return fail(f"{where}: {why}", _diagnose_linear(output, case, got, want))
    return _report(Result(name, True, f"all {len(_LINEAR_CASES)} cases match: the counts, the "
                                      "time floors and the bounds"), show)


register(Exercise(
    name="linear_roofline", lesson="02_gpu_memory", kind="python",
    writes="a linear layer's FLOPs and bytes, counted, and its time floor and bound on a GPU",
    lines=6, check=check_linear_roofline, solution=linear_roofline_solution,
    stub=linear_roofline,
    mistakes=tuple(Mistake(label, _linear_wrong(**slip), label) for label, slip in (
        ("TFLOP/s used as FLOP/s", {"flop_unit": 1}),
        ("TB/s read as GB/s", {"byte_unit": 1e9}),
        ("the two times added, not the larger one taken", {"combine": lambda c, m: c + m}),
        ("the shorter of the two times", {"combine": min}),
        ("the time in seconds, not µs", {"per_s": 1}),
        ("the bound the wrong way round", {"inverted": True}),
        ("bytes counted as elements", {"bytes_per_el": 1}),
        ("only the weights counted", {"weights_only": True}),
        ("a multiply-add counted as one FLOP", {"flops_per_term": 1}))),
    hints=LINEAR_HINTS))


def _qk_intensity(N: int, d: int, H: int) -> float:
    from course_lib.iomodel.attention import standard_attention_steps

    step = standard_attention_steps(N, d, H=H)[0]
    return step["flops"] / step["hbm_bytes"]


def _q02_answer() -> tuple[str, float]:
    from course_lib import roofline as rl

    N, H = 4096, 16
    i64, i128 = _qk_intensity(N, 64, H), _qk_intensity(N, 128, H)
    ridge = GPUS["H100-SXM"].ridge_point("fp16")
    d_ridge = ridge / (1 - 2 * ridge / N)
    row = rl.classify("H100-SXM", rl.lesson_ops("H100-SXM", N=N, d=128, H=H))[0]
    text = (
        f"Per head, S = QKᵀ does 2·N²·d FLOPs and moves Q and K in (2·N·d elements) and S out "
        f"(N² elements), 2 bytes each. The intensity is 2N²d / (2·(N² + 2Nd)) = d / (1 + 2d/N) "
        f"FLOP/B: about d, since N ≫ d. Doubling d doubles the FLOPs, while the bytes are "
        f"dominated by S, which does not depend on d.\n\n"
        f"N = {N}, {H} heads: d = 64 gives {i64:.1f} FLOP/B, d = 128 gives {i128:.1f} FLOP/B. "
        f"The point moves right by a factor of {i128 / i64:.2f}, and up the slanted roof. The "
        f"H100's ridge point is {ridge:.0f} FLOP/B, so at {i128:.0f} S = QKᵀ is still "
        f"{row['bound']}-bound (rl.classify says the same): the N × N matrix written to HBM "
        f"sets its time, as for every step of standard attention. Reaching the ridge would take "
        f"d / (1 + 2d/N) = {ridge:.0f}, a head dimension of about {d_ridge:.0f}; models use 64 "
        f"to 256.")
    return text, i128


_Q02_TEXT, _Q02_VALUE = _q02_answer()
register(Question(
    name="q02_qk_d128", lesson="02_gpu_memory",
    asks="With d = 128 instead of 64, where does S = QKᵀ move on the roofline (its intensity in "
         "FLOP/B, N = 4096, 16 heads, fp16), and is it still memory-bound on an H100?",
    answer=_Q02_TEXT, value=_Q02_VALUE))


# ==============================================================================================
# Lesson 03: the read count
# ==============================================================================================

def hbm_reads(M, N, K, T):
    # TODO: elements of A and B that the tiled kernel with T × T tiles reads from HBM
    raise NotImplementedError


def _hbm_reads_solution(M, N, K, T):
    tile_rows = math.ceil(M / T)            # rows of C tiles: each one loads all of B
    tile_cols = math.ceil(N / T)            # columns of C tiles: each one loads all of A
    return M * K * tile_cols + K * N * tile_rows


def _reads_no_ceiling(M, N, K, T):
    return 2 * M * N * K // T               # right only when T divides M and N


def _reads_floor(M, N, K, T):
    return M * K * (N // T) + K * N * (M // T)


def _reads_swapped(M, N, K, T):
    return M * K * math.ceil(M / T) + K * N * math.ceil(N / T)


READ_HINTS = (
    "count A and B separately. Which C tiles need a given element A[i, k]? Every tile in row i's "
    "band of C tiles, and each of them loads it once.",
    "a band of C tiles has as many tiles as C has tile columns (for A) or tile rows (for B). At "
    "a ragged edge the last tile is partial but still a tile: it loads only the elements inside "
    "the matrix (a masked load).",
    "T = 1 must give the naive count 2·M·N·K, and T ≥ M, N must give every element of A and B "
    "read once.",
)


def _read_cases():
    return [(32, 32, 32, 16), (64, 64, 64, 8), (48, 40, 32, 16), (17, 5, 9, 4), (20, 28, 24, 1),
            (8, 8, 8, 32)]


def check_read_count(student, show: bool = True) -> Result:
    """``student(M, N, K, T)``: elements of A and B read from HBM by the tiled kernel."""
    return check("read_count", student, lambda m, n, k, t: matmul_global_reads(m, n, k, t),
                 _read_cases(), hints=READ_HINTS, rtol=0.0, atol=0.0, show=show,
                 describe=lambda c: "M = {}, N = {}, K = {}, T = {}".format(*c))


register(Exercise(
    name="read_count", lesson="03_tiled_matmul", kind="python",
    writes="the HBM reads of the tiled matmul, ragged edges included", lines=3,
    check=check_read_count, solution=_hbm_reads_solution, stub=hbm_reads,
    mistakes=(Mistake("2MNK/T, no ragged edges", _reads_no_ceiling, "values differ"),
              Mistake("rounding the tile counts down", _reads_floor, "values differ"),
              Mistake("A once per tile row, B once per tile column", _reads_swapped,
                      "values differ")),
    hints=READ_HINTS))


# ==============================================================================================
# Lesson 03: the tiled loop
# ==============================================================================================

def my_tiled_matmul(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    # TODO: loop over C's tiles, then over the phases k0 along K: load, accumulate, store once
    raise NotImplementedError


def _tiled_loop_solution(A, B, C, T):
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


def _loop_store_every_phase(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    for i0 in range(0, M, T):
        for j0 in range(0, N, T):
            acc = np.zeros((min(T, M - i0), min(T, N - j0)))
            for k0 in range(0, K, T):
                acc += A[i0:i0 + T, k0:k0 + T] @ B[k0:k0 + T, j0:j0 + T]
                C[i0:i0 + T, j0:j0 + T] = acc


def _loop_whole_matrices(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    a, b = A[0:M, 0:K], B[0:K, 0:N]               # everything on chip at once: not tiled
    for i0 in range(0, M, T):
        for j0 in range(0, N, T):
            C[i0:i0 + T, j0:j0 + T] = a[i0:i0 + T] @ b[:, j0:j0 + T]


def _loop_accumulator_not_reset(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    for i0 in range(0, M, T):
        acc = np.zeros((min(T, M - i0), T))
        for j0 in range(0, N, T):
            for k0 in range(0, K, T):
                acc[:, :min(T, N - j0)] += A[i0:i0 + T, k0:k0 + T] @ B[k0:k0 + T, j0:j0 + T]
            C[i0:i0 + T, j0:j0 + T] = acc[:, :min(T, N - j0)]


def _loop_square_accumulator(A, B, C, T):
    M, K = A.shape
    N = B.shape[1]
    for i0 in range(0, M, T):
        for j0 in range(0, N, T):
            acc = np.zeros((T, T))
            for k0 in range(0, K, T):
                acc += A[i0:i0 + T, k0:k0 + T] @ B[k0:k0 + T, j0:j0 + T]
            C[i0:i0 + T, j0:j0 + T] = acc


LOOP_HINTS = (
    "three loops: the outer two walk over C's tiles in steps of T (rows, then columns); the "
    "inner one walks along K in steps of T. Slicing clips at the edges, so the loads need no "
    "bounds of their own.",
    "each C tile has its own accumulator, zeroed before its K loop. At the bottom and right "
    "edges a C tile is smaller than T × T: shape the accumulator like the tile.",
    "inside the K loop: one slice of A from the tile's rows, one slice of B from its columns "
    "(each slice is counted as HBM reads), and their product added to the accumulator. After "
    "the K loop, one write of the whole C tile.",
)
LOOP_NUDGES = {
    "broadcast": LOOP_HINTS[1],
    "written to HBM": "write each C tile once, after its K loop has finished: a write inside "
                      "the K loop costs a tile of HBM writes per phase.",
    "C is right, but the loop read": "the answer is right but the reads are not the tiled "
                                     "ones: load one T-wide tile of A and one of B per phase, "
                                     "for every C tile, and nothing else.",
    "differs from A·B": LOOP_HINTS[1],
}


def check_tiled_loop(student, show: bool = True) -> Result:
    """``student(A, B, C, T)``: C must equal A·B, the HBM reads must be the tiled count, and
    every element of C must be written once."""
    name = "tiled_loop"
    rng = np.random.default_rng(0)
    cases = ((32, 32, 32, 16), (32, 32, 32, 8), (20, 28, 24, 8), (17, 5, 9, 4), (1, 7, 3, 2))

    def fail(why: str) -> Result:
        return _report(Result(name, False, why + _nudge(name, LOOP_HINTS, why, LOOP_NUDGES)),
                       show)

    for n, (m, nn, k, T) in enumerate(cases):
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, nn))
        t = Traffic()
        A = CountingMatrix(a.copy(), t, "global", "A")
        B = CountingMatrix(b.copy(), t, "global", "B")
        C = CountingMatrix(np.full((m, nn), np.nan), t, "global", "C")
        where = f"case {n} ({m}×{k} · {k}×{nn}, T = {T})"
        try:
            student(A, B, C, T)
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            return fail(f"{where} raised {type(exc).__name__}: {exc}")
        if t.global_writes == 0:
            return fail(f"{where}: C was never written")
        why = _compare(C.data, a @ b, rtol=1e-9, atol=1e-9)
        if why:
            return fail(f"{where}: C differs from A·B: {why}")
        want = matmul_global_reads(m, nn, k, T)
        if t.global_reads != want:
            return fail(f"{where}: C is right, but the loop read {t.global_reads} elements from "
                        f"HBM (A {t.reads_by_tensor.get('A', 0)}, B "
                        f"{t.reads_by_tensor.get('B', 0)}); the tiled loop reads {want}")
        if t.global_writes != m * nn:
            return fail(f"{where}: C is right, but {t.global_writes} elements were written to "
                        f"HBM, not {m * nn}")
    return _report(Result(name, True, f"all {len(cases)} cases: C = A·B, and the HBM reads "
                                      "and writes are the tiled loop's"), show)


register(Exercise(
    name="tiled_loop", lesson="03_tiled_matmul", kind="python",
    writes="the tiled loop nest of C = A·B on counted matrices", lines=8,
    check=check_tiled_loop, solution=_tiled_loop_solution, stub=my_tiled_matmul,
    mistakes=(Mistake("C written in every phase", _loop_store_every_phase, "written to HBM"),
              Mistake("whole A and B loaded at once: not tiled", _loop_whole_matrices,
                      "C is right, but the loop read"),
              Mistake("one accumulator for a whole row of C tiles", _loop_accumulator_not_reset,
                      "differs from A·B"),
              Mistake("a T × T accumulator at the ragged edges", _loop_square_accumulator,
                      "broadcast")),
    hints=LOOP_HINTS))


# ==============================================================================================
# Lesson 03: the K loop of a minimal tiled matmul, in Triton
# ==============================================================================================

# --- what the notebook shows -------------------------------------------------------------------
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A (M, K), B (K, N) and C (M, N) are row-major: A[i, k] lives at a_ptr + i * K + k
    pid_m = tl.program_id(axis=0)                    # this program's row of C tiles
    pid_n = tl.program_id(axis=1)                    # ... and column of C tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]        # (BLOCK_M, BLOCK_K)
    b_ptrs = ...  # TODO: the (BLOCK_K, BLOCK_N) block of pointers into B
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = (offs_m[:, None] < M) & (k0 + offs_k[None, :] < K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b_mask = ...  # TODO: True for the lanes of this B tile that lie inside B
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = ...  # TODO: add this step's product of the two tiles
        a_ptrs += BLOCK_K
        ...  # TODO: move b_ptrs one step of BLOCK_K along K
    c_ptrs = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    ...  # TODO: store acc into C, only the lanes inside the M × N output


# --- the reference and the mistakes ------------------------------------------------------------
@triton.jit
def _matmul_solution(a_ptr, b_ptr, c_ptr, M, N, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = (offs_m[:, None] < M) & (k0 + offs_k[None, :] < K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b_mask = (k0 + offs_k[:, None] < K) & (offs_n[None, :] < N)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    c_ptrs = c_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# Each registered wrong answer is the reference with one slip (``kernel_variant``).
_B_PTRS = "b_ptrs = b_ptr + offs_k[:, None] * N + offs_n[None, :]"
_B_MASK = "b_mask = (k0 + offs_k[:, None] < K) & (offs_n[None, :] < N)"
_B_STEP = "b_ptrs += BLOCK_K * N"
_matmul_store_unmasked = kernel_variant(
    _matmul_solution, ("acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))", "acc)"))
_matmul_b_mask_k_only = kernel_variant(
    _matmul_solution, (_B_MASK, "b_mask = k0 + offs_k[:, None] < K"))
_matmul_b_mask_without_k0 = kernel_variant(
    _matmul_solution, (_B_MASK, "b_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)"))
_matmul_acc_overwritten = kernel_variant(
    _matmul_solution, ("acc = tl.dot(a, b, acc)", "acc = tl.dot(a, b)"))
_matmul_b_advanced_along_n = kernel_variant(_matmul_solution, (_B_STEP, "b_ptrs += BLOCK_K"))
_matmul_b_rows_k_long = kernel_variant(  # A's row length, copied to B
    _matmul_solution, (_B_PTRS, "b_ptrs = b_ptr + offs_k[:, None] * K + offs_n[None, :]"),
    (_B_STEP, "b_ptrs += BLOCK_K * K"))
_matmul_b_block_transposed = kernel_variant(
    _matmul_solution, (_B_PTRS, "b_ptrs = b_ptr + offs_k[None, :] * N + offs_n[:, None]"),
    (_B_MASK, "b_mask = (k0 + offs_k[None, :] < K) & (offs_n[:, None] < N)"))


def _matmul_in_torch(a, b):
    return a.float() @ b.float()


# --- the checker -------------------------------------------------------------------------------
def prepare_matmul(a, b, block_m, block_n, block_k):
    """One launch: a (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) grid of programs, C in fp32, poisoned."""
    M, K = a.shape
    N = b.shape[1]
    c = poisoned(M, N, like=a, dtype=torch.float32)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = dict(a_ptr=a, b_ptr=b, c_ptr=c, M=M, N=N, K=K,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return grid, args, c


MATMUL_HINTS = (
    "B is (K, N) and row-major, so B[k, n] lives at b_ptr + k·N + n. Its block for this program "
    "has the K offsets down its rows and the N offsets across its columns: the same recipe as "
    "a_ptrs, with the roles of rows and columns those of B.",
    "the B tile can hang over two edges: past K on the last step (rows k0 + offs_k), and past N "
    "in the last column of tiles. Its mask combines both conditions, like a_mask does for A.",
    "tl.dot(x, y, acc) returns acc + x @ y, accumulated in acc's dtype (fp32 here). One step "
    "along K moves B's pointers down BLOCK_K rows; a row of B is N elements long.",
    "the store is tl.store(pointers, values, mask=...): C's tile hangs over M at the bottom and "
    "over N at the right, so its mask checks offs_m against M and offs_n against N.",
)
MATMUL_NUDGES = {
    "tl.load out of bounds": "a B load reads outside B: does b_mask check both edges, the K "
                             "rows still left (k0 + offs_k) and the N columns?",
    "tl.store out of bounds": "the store writes outside C: mask it with the rows inside M and "
                              "the columns inside N.",
    "values differ": "every access stayed in bounds, but C is wrong. Check, in order: B's "
                     "block of pointers (K down its rows, N across its columns), the step that "
                     "moves it along K (how far apart are two rows of B?), and that acc keeps "
                     "the sum of every step, not only the last one.",
}


def _matmul_cases():
    gen = torch.Generator().manual_seed(0)

    def case(M, N, K, bm, bn, bk):
        return (torch.randn(M, K, generator=gen).half(), torch.randn(K, N, generator=gen).half(),
                bm, bn, bk)

    return [case(16, 16, 16, 16, 16, 16),       # one tile, one step
            case(37, 45, 29, 16, 16, 16),       # ragged M, N and K: every mask matters
            case(20, 70, 50, 16, 32, 16)]       # four steps along K, BLOCK_N ≠ BLOCK_K


def _describe_matmul(c) -> str:
    a, b, bm, bn, bk = c
    return (f"M = {a.shape[0]}, N = {b.shape[1]}, K = {a.shape[1]}, "
            f"BLOCK_M = {bm}, BLOCK_N = {bn}, BLOCK_K = {bk}")


def check_matmul_kernel(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` matmul; C = A·B (fp16 inputs, fp32 C) on ragged shapes."""
    return check_kernel("matmul_k_loop", kernel, prepare_matmul,
                        lambda a, b, *blocks: (a.double() @ b.double()).float(),
                        _matmul_cases(), hints=MATMUL_HINTS, rtol=1e-4, atol=1e-4, show=show,
                        describe=_describe_matmul, nudges=MATMUL_NUDGES)


register(Exercise(
    name="matmul_k_loop", lesson="03_tiled_matmul", kind="triton",
    writes="B's pointer block and mask, the tl.dot accumulation, the K step, the masked store",
    lines=5, check=check_matmul_kernel, solution=_matmul_solution, stub=matmul_kernel,
    extra=(prepare_matmul,),
    mistakes=(Mistake("the store without its mask", _matmul_store_unmasked,
                      "tl.store out of bounds"),
              Mistake("B's mask checks K only, not N", _matmul_b_mask_k_only,
                      "tl.load out of bounds"),
              Mistake("B's mask compares offs_k, not k0 + offs_k, with K",
                      _matmul_b_mask_without_k0, "tl.load out of bounds"),
              Mistake("acc overwritten by each step's product", _matmul_acc_overwritten,
                      "values differ"),
              Mistake("b_ptrs advanced by BLOCK_K, along N", _matmul_b_advanced_along_n,
                      "values differ"),
              Mistake("B's block of pointers transposed", _matmul_b_block_transposed,
                      "values differ"),
              Mistake("B's rows taken as K elements long (A's row length), not N",
                      _matmul_b_rows_k_long, "values differ"),
              Mistake("an answer in PyTorch, no kernel", _matmul_in_torch, "@triton.jit kernel")),
    hints=MATMUL_HINTS))


# ==============================================================================================
# Lesson 03: grouped program order, in Triton
# ==============================================================================================

# --- what the notebook shows -------------------------------------------------------------------
@triton.jit
def grouped_order_kernel(pid_m_ptr, pid_n_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_in_group = GROUP_M * num_pid_n           # programs in one band of GROUP_M tile rows
    group_id = ...  # TODO: which band this program works in
    first_pid_m = group_id * GROUP_M                 # the band's first row of tiles
    group_size_m = ...  # TODO: rows of tiles in this band (the last band may be shorter)
    pid_m = ...  # TODO: this program's row of tiles: consecutive pids go down the band
    pid_n = ...  # TODO: this program's column of tiles
    tl.store(pid_m_ptr + pid, pid_m)
    tl.store(pid_n_ptr + pid, pid_n)


# --- the reference and the mistakes ------------------------------------------------------------
@triton.jit
def _grouped_solution(pid_m_ptr, pid_n_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    tl.store(pid_m_ptr + pid, pid_m)
    tl.store(pid_n_ptr + pid, pid_n)


@triton.jit
def _grouped_row_major(pid_m_ptr, pid_n_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(axis=0)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    tl.store(pid_m_ptr + pid, pid_m)
    tl.store(pid_n_ptr + pid, pid_n)


_PID_M = "pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m"
_grouped_full_last_band = kernel_variant(
    _grouped_solution, ("group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)",
                        "group_size_m = GROUP_M"))
_grouped_no_first_row = kernel_variant(
    _grouped_solution, (_PID_M, "pid_m = (pid % num_pid_in_group) % group_size_m"))
_grouped_pid_n_not_in_band = kernel_variant(
    _grouped_solution, ("pid_n = (pid % num_pid_in_group) // group_size_m",
                        "pid_n = pid // group_size_m"))
_grouped_across_first = kernel_variant(
    _grouped_solution, (_PID_M, "pid_m = first_pid_m + (pid % num_pid_in_group) // num_pid_n"),
    ("pid_n = (pid % num_pid_in_group) // group_size_m",
     "pid_n = (pid % num_pid_in_group) % num_pid_n"))


# --- the checker -------------------------------------------------------------------------------
def prepare_grouped(num_pid_m, num_pid_n, group_m, like):
    """One program per C tile; each stores its (pid_m, pid_n) at index pid (poisoned first).
    ``like``: an empty tensor on the device the outputs go to (the checker moves it to the GPU
    for the compiled pass)."""
    n = num_pid_m * num_pid_n
    pid_m, pid_n = poisoned(n, like=like), poisoned(n, like=like)
    args = dict(pid_m_ptr=pid_m, pid_n_ptr=pid_n, num_pid_m=num_pid_m, num_pid_n=num_pid_n,
                GROUP_M=group_m)
    return (n,), args, (pid_m, pid_n)


def _grouped_spec(num_pid_m, num_pid_n, group_m, like):
    tiles = [program_tile(p, num_pid_m, num_pid_n, group_m) for p in range(num_pid_m * num_pid_n)]
    return (torch.tensor([m for m, _ in tiles], dtype=torch.float32),
            torch.tensor([n for _, n in tiles], dtype=torch.float32))


GROUPED_HINTS = (
    "a band is GROUP_M rows of tiles, all num_pid_n columns of them: num_pid_in_group programs. "
    "Program pid is in band number pid // (programs per band), and at position "
    "pid % (programs per band) inside it.",
    "the last band has only the rows left over, num_pid_m − first_pid_m, when that is fewer "
    "than GROUP_M (tl.minimum takes the smaller). Every later formula divides by this size.",
    "inside a band the order is column by column: positions 0, 1, … go down the first column "
    "of the band, then the next column. Down a column is a remainder (% rows in the band), "
    "across is a quotient (// rows in the band); pid_m is relative to the band's first row.",
)


def _describe_grouped(c) -> str:
    m, n, g, _ = c
    band = "" if m % g == 0 or g >= m else f"; the last band has {m % g} row(s)"
    return f"{m} × {n} tiles, GROUP_M = {g}{band}"


def check_grouped_order(kernel, show: bool = True) -> Result:
    """``kernel``: your grouped-order kernel; a failure names pid_m or pid_n."""
    cases = [(m, n, g, torch.empty(0)) for m, n, g in
             ((4, 3, 2), (7, 6, 3), (5, 4, 8), (3, 5, 1), (2, 9, 4))]
    return check_kernel("grouped_order", kernel, prepare_grouped, _grouped_spec, cases,
                        hints=GROUPED_HINTS, rtol=0, atol=0, show=show,
                        describe=_describe_grouped,
                        nudges={"the last band has": "in this case the last band is short: "
                                                     + GROUPED_HINTS[1],
                                "pid_m:": "pid_m is off: " + GROUPED_HINTS[2],
                                "pid_n:": "pid_n is off: " + GROUPED_HINTS[2]},
                        names=("pid_m", "pid_n"))


register(Exercise(
    name="grouped_order", lesson="03_tiled_matmul", kind="triton",
    writes="the grouped program order: pid -> (pid_m, pid_n), GROUP_M rows at a time", lines=4,
    check=check_grouped_order, solution=_grouped_solution, stub=grouped_order_kernel,
    extra=(prepare_grouped,),
    mistakes=(Mistake("the last band taken as GROUP_M rows", _grouped_full_last_band,
                      "values differ"),
              Mistake("row-major order, no bands", _grouped_row_major, "values differ"),
              Mistake("pid_m without the band's first row", _grouped_no_first_row,
                      "values differ"),
              Mistake("pid_n from pid, not from the position in the band",
                      _grouped_pid_n_not_in_band, "values differ"),
              Mistake("across the band first, not down", _grouped_across_first,
                      "values differ")),
    hints=GROUPED_HINTS))


# ==============================================================================================
# Lesson 03: the launch of a strided matmul: the grid, the output, every tensor's strides
# ==============================================================================================

# --- what the notebook shows -------------------------------------------------------------------
@triton.jit
def strided_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                          stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A[i, k] lives at a_ptr + i * stride_am + k * stride_ak: any layout, a view included
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k0 + offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def launch_matmul(kernel, a, b):
    # TODO: C (M, N) in float32 on a's device; a grid of 16 × 16 tiles; one launch of kernel
    # with every tensor's two strides; BLOCK_M = BLOCK_N = BLOCK_K = 16; return C
    raise NotImplementedError


# --- the reference and the mistakes ------------------------------------------------------------
def _launch_matmul_solution(kernel, a, b):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(M, 16), triton.cdiv(N, 16))
    kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 c.stride(0), c.stride(1), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    return c


def _launch_as(kernel, a, b, cdiv=triton.cdiv, strides=None, b_passed=None):
    """``_launch_matmul_solution`` with one thing done wrong: the grid rounded by ``cdiv``,
    the strides ``strides(a, b, c)``, or ``b_passed`` handed to the kernel in place of b."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    strides = strides or (lambda a, b, c: (a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                           c.stride(0), c.stride(1)))
    kernel[(cdiv(M, 16), cdiv(N, 16))](a, b if b_passed is None else b_passed, c, M, N, K,
                                       *strides(a, b, c), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    return c


def _launch_row_major(kernel, a, b):
    return _launch_as(kernel, a, b, strides=lambda a, b, c: (a.shape[1], 1, b.shape[1], 1,
                                                             b.shape[1], 1))


def _launch_floor(kernel, a, b):
    return _launch_as(kernel, a, b, cdiv=lambda n, d: n // d)


def _launch_b_strides_swapped(kernel, a, b):
    return _launch_as(kernel, a, b, strides=lambda a, b, c: (a.stride(0), a.stride(1),
                                                             b.stride(1), b.stride(0),
                                                             c.stride(0), c.stride(1)))


def _launch_contiguous_copy_lost(kernel, a, b):
    """.contiguous() on B, but the strides still read from the view."""
    return _launch_as(kernel, a, b, b_passed=b.contiguous())


def _launch_cases():
    """A and B row-major; B a transposed view of an (N, K) tensor; A the columns 2 … K + 1 of
    a wider matrix and B transposed."""
    gen = torch.Generator().manual_seed(3)
    a1, b1 = torch.randn(37, 29, generator=gen), torch.randn(29, 45, generator=gen)
    a2, b2 = torch.randn(20, 40, generator=gen), torch.randn(33, 40, generator=gen).T
    a3 = torch.randn(18, 50, generator=gen)[:, 2:35]
    b3 = torch.randn(30, 33, generator=gen).T
    return [(a1.half(), b1.half()), (a2.half(), b2.half()), (a3.half(), b3.half())]


def _describe_launch(case) -> str:
    a, b = case

    def layout(t):
        if t.is_contiguous():
            return "row-major"
        if t.T.is_contiguous():
            return "a transposed view (strides " + str(t.stride()) + ")"
        return f"a slice of a wider matrix (strides {t.stride()})"

    return (f"A {tuple(a.shape)} {layout(a)}, B {tuple(b.shape)} {layout(b)}")


def check_launch_matmul(student, show: bool = True) -> Result:
    """``student(kernel, a, b) -> C``: your launch of ``strided_matmul_kernel``; C = A·B in
    float32 for row-major A and B, B a transposed view, A a slice of a wider matrix."""
    from course_lib.exercises import sandbox
    from course_lib.exercises.puzzles import _Recorder

    def run(a, b):
        kernel = _Recorder(strided_matmul_kernel)  # records the launch; it runs below
        c = student(kernel, a, b)
        if c is None:
            return None
        if len(kernel.launches) != 1:
            raise ValueError(f"your function launched the kernel {len(kernel.launches)} times; "
                             "it should launch it once: kernel[grid](...)")
        grid, args = kernel.launches[0]
        if isinstance(args.get("c_ptr"), torch.Tensor):
            args["c_ptr"].fill_(float("nan"))  # an element never written shows as NaN
        tensors = {n: t for n, t in args.items() if isinstance(t, torch.Tensor)}
        oob = sandbox.run(strided_matmul_kernel, grid, args, tensors)
        if oob:
            raise IndexError(oob)
        return c

    return check("launch_matmul", run, lambda a, b: a.double() @ b.double(), _launch_cases(),
                 hints=LAUNCH_HINTS, rtol=1e-3, atol=1e-3, show=show,
                 describe=_describe_launch, nudges=LAUNCH_NUDGES)


LAUNCH_HINTS = (
    "the kernel's programs are (pid_m, pid_n): the grid is a pair, the number of 16-row tiles "
    "of C, then the number of 16-column tiles, each rounded up (triton.cdiv).",
    "pass the arguments in the kernel's order: the three tensors, M, N, K, then two strides "
    "for each tensor, read from it with .stride(0) and .stride(1), then the three blocks as "
    "keywords.",
    "a view shares its storage: B = x.T has the strides of x swapped, (1, K), and the kernel "
    "reads it in place through them. Never assume (N, 1).",
)
LAUNCH_NUDGES = {
    "NameError": "your function uses a name this notebook has not defined: import what it "
                 "needs (torch to allocate C, triton for triton.cdiv) above it.",
    "the kernel takes": "count the arguments against the kernel's parameters, in order.",
    "NaN": "some of C was never written: does the grid cover the last, partial tile of rows "
           "and of columns?",
    "a transposed view": "here B is a transposed view: its strides are not (N, 1). Read them "
                         "from the tensor.",
    "tl.load out of bounds": "the kernel read outside a tensor: are the strides each tensor's "
                             "own, in the kernel's order (the row stride, then the column "
                             "stride)?",
}


register(Exercise(
    name="launch_matmul", lesson="03_tiled_matmul", kind="python",
    writes="the host side: C, the grid from triton.cdiv, one launch with every tensor's strides",
    lines=5, check=check_launch_matmul, solution=_launch_matmul_solution, stub=launch_matmul,
    mistakes=(Mistake("strides assumed row-major: (K, 1), (N, 1), (N, 1)", _launch_row_major,
                      "a transposed view"),
              Mistake("the grid rounded down", _launch_floor, "NaN"),
              Mistake("B's two strides swapped", _launch_b_strides_swapped,
                      "tl.load out of bounds"),
              Mistake("B made contiguous, its strides still read from the view",
                      _launch_contiguous_copy_lost, "values differ")),
    hints=LAUNCH_HINTS))
