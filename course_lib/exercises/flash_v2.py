"""Exercises of notebooks/08_triton_flash_v2.ipynb and 09_hopper.ipynb.

08: one online-softmax step of the kernel's inner loop, in torch with exp2; the kinds of the
key blocks of one Q block (bottom-right causal). 09: how many pipeline stages fit in shared
memory; the two numbers of the softmax/MMA ceiling.

Each ``check_*`` runs the student's function on seeded cases and compares it with the spec
(the reference solution beside it, tested in tests/test_flash_v2_plan.py).
"""
from __future__ import annotations

import math

import torch

from course_lib.exercises import Result, check
from course_lib.kernels.flash_v2_plan import KINDS, key_block_kinds
from course_lib.kernels.hopper_plan import max_stages, score_costs
from course_lib.reference import attention

LOG2E = 1.0 / math.log(2.0)

# --- 08 (1): the online-softmax step ---------------------------------------------------------


def online_softmax_step_solution(qk, m_i, l_i, acc, v, qk_scale):
    """One step of the kernel's loop on a (rows, BLOCK_N) tile of raw scores ``qk`` = q·kᵀ.

    m_i, l_i (rows,) and acc (rows, D) carry the state in the exp2 domain (m_i is the running
    max of qk·qk_scale, with qk_scale = sm_scale·log2 e); v (BLOCK_N, D). Returns the new
    (m_i, l_i, acc): acc is rescaled by α = 2^(m_old − m_new), never divided.
    """
    m_new = torch.maximum(m_i, (qk * qk_scale).amax(dim=-1))
    p = torch.exp2(qk * qk_scale - m_new[:, None])
    alpha = torch.exp2(m_i - m_new)
    return m_new, l_i * alpha + p.sum(dim=-1), acc * alpha[:, None] + p @ v


def _step_cases():
    gen = torch.Generator().manual_seed(8)
    cases = []
    for rows, bn, d, first in ((1, 1, 1, True), (4, 8, 3, True), (5, 16, 8, False),
                               (3, 4, 2, False)):
        qk = torch.randn(rows, bn, generator=gen, dtype=torch.float64) * 3
        v = torch.randn(bn, d, generator=gen, dtype=torch.float64)
        if first:  # before the first key block: m = -inf, l = 0, acc = 0
            m = torch.full((rows,), float("-inf"), dtype=torch.float64)
            l, acc = torch.zeros(rows, dtype=torch.float64), torch.zeros(rows, d,
                                                                         dtype=torch.float64)
        else:
            m = torch.randn(rows, generator=gen, dtype=torch.float64) * 2
            l = torch.rand(rows, generator=gen, dtype=torch.float64) * 3 + 1
            acc = torch.randn(rows, d, generator=gen, dtype=torch.float64)
        cases.append((qk, m, l, acc, v, 0.125 * LOG2E))
    return cases


def _folded(step, q, k, v, block_n, sm_scale):
    """O for one head from ``step`` over every key block, then the one division at the end."""
    qk_scale = sm_scale * LOG2E
    rows, d = q.shape
    m = torch.full((rows,), float("-inf"), dtype=q.dtype)
    l, acc = torch.zeros(rows, dtype=q.dtype), torch.zeros(rows, d, dtype=q.dtype)
    for c0 in range(0, k.shape[0], block_n):
        m, l, acc = step(q @ k[c0:c0 + block_n].T, m, l, acc, v[c0:c0 + block_n], qk_scale)
    return acc / l[:, None]


def check_online_softmax_step(student) -> Result:
    """Step by step against the spec, then folded over all key blocks against attention()."""
    hint = ("m_new = max(m_i, rowmax(qk)·qk_scale); p = 2^(qk·qk_scale − m_new); "
            "α = 2^(m_i − m_new); l_new = α·l_i + rowsum(p); acc_new = α·acc + p @ v")
    first = check("online-softmax step", student, online_softmax_step_solution, _step_cases(),
                  hint=hint, rtol=1e-9, atol=1e-12)
    if not first:
        return first
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (7, 50, 50))
    sm = 16 ** -0.5

    def whole(q, k, v):
        return attention(q[None, None], k[None, None], v[None, None], sm_scale=sm)[0, 0]

    return check("your step over all key blocks, then O = acc / l", lambda q, k, v: _folded(
        student, q, k, v, 16, sm), whole, [(q, k, v)], hint=hint, rtol=1e-9, atol=1e-12)


# --- 08 (2): the kinds of key blocks ---------------------------------------------------------


def block_kinds_solution(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    """The kind ("skipped", "unmasked" or "masked") of every key block of the causal Q block
    whose first row is ``start_m``: what ``flash_v2._causal_bounds`` decides."""
    return [KINDS[c] for c in key_block_kinds(start_m, N_q, N_k, BLOCK_M, BLOCK_N, True)]


def _codes(fn):
    def run(*args):
        got = fn(*args)
        if got is None:
            return None
        got = list(got)
        bad = [g for g in got if g not in KINDS]
        if bad:
            raise ValueError(f"kinds must be one of {KINDS}, got {bad[0]!r}")
        return [KINDS.index(g) for g in got]
    return run


def check_block_kinds(student) -> Result:
    cases = [(0, 64, 64, 16, 16), (48, 64, 64, 16, 16), (32, 100, 100, 32, 16),
             (96, 100, 100, 32, 16), (0, 30, 100, 32, 16), (64, 130, 60, 64, 32),
             (0, 130, 60, 64, 32), (128, 130, 60, 64, 32), (256, 1000, 1000, 128, 64),
             (896, 1000, 1000, 128, 64)]
    return check("key block kinds", _codes(student), _codes(block_kinds_solution), cases,
                 rtol=0, atol=0,
                 hint="query row i sees key j iff j <= i + N_k − N_q; a block is skipped if no "
                      "row of the Q block sees any of its keys, unmasked if every row sees "
                      "every key (and all BLOCK_N keys exist, j < N_k), masked otherwise "
                      "(the message shows kinds as codes: 0 skipped, 1 unmasked, 2 masked)")


# --- 09 (1): pipeline stages in shared memory -------------------------------------------------


def max_stages_solution(BLOCK_M, BLOCK_N, D, budget_bytes):
    """The most K/V stages (fp16 K and V tiles per stage) that fit beside the Q tile."""
    return max_stages(BLOCK_M, BLOCK_N, D, budget_bytes)


def check_max_stages(student) -> Result:
    kib = 1024
    cases = [(128, 64, 64, 228 * kib), (128, 128, 128, 227 * kib), (128, 64, 128, 227 * kib),
             (64, 64, 256, 227 * kib), (128, 128, 256, 227 * kib), (64, 32, 64, 99 * kib),
             (128, 128, 128, 163 * kib)]
    return check("pipeline stages that fit", student, max_stages_solution, cases, rtol=0,
                 atol=0, hint="fp16 is 2 bytes: the Q tile is BLOCK_M·D·2 bytes, one stage "
                             "holds a K and a V tile, 2·BLOCK_N·D·2 bytes; how many stages "
                             "fit in what the Q tile leaves? (0 if none)")


# --- 09 (2): the two numbers ----------------------------------------------------------------


def two_numbers_solution(D, BLOCK_N=128):
    """(MMA picoseconds, softmax picoseconds) per score element on an H100 SXM."""
    c = score_costs(D, "H100-SXM", BLOCK_N)
    return c["mma_ps"], c["softmax_ps"]


def check_two_numbers(student) -> Result:
    cases = [(64, 128), (128, 128), (128, 64), (256, 64), (32, 32)]
    return check("the two numbers", student, two_numbers_solution, cases, rtol=1e-6, atol=0,
                 hint="MMA: 4·D FLOPs at 989.4e12 FLOP/s; softmax: one exp2 at the MUFU rate "
                      "(67e12 / 2 · 16/128 per second) plus 3.5 + D/BLOCK_N FP32 instructions "
                      "at 67e12 / 2 per second; times 1e12 for picoseconds")
