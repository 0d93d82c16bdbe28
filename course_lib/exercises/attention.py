"""Exercises of notebooks/04_attention_io, 05_one_pass_attention and 06_flash_v1_algorithm.

Each ``check_*`` takes the student's function, runs it on seeded cases and compares it with the
reference solution beside it (``*_solution``, tested in tests/test_iomodel_attention.py).
"""
from __future__ import annotations

import torch

from course_lib.exercises import check
from course_lib.iomodel.attention import paper_block_sizes, standard_attention_io

# --- 04: standard attention's HBM traffic ----------------------------------------------------

def standard_io_solution(N, d):
    """Elements standard attention moves for one head: Q, K read, S written; S read, P written;
    P, V read, O written."""
    return 2 * N * d + N * N + N * N + N * N + N * N + N * d + N * d


def check_standard_io(student):
    cases = [(1, 1), (128, 64), (1000, 80), (4096, 128)]
    return check("standard attention's HBM elements", student,
                 lambda N, d: standard_attention_io(N, N, d)["elements"], cases, rtol=0, atol=0,
                 hint="list the 8 HBM operations of the three kernels; S and P are N×N, "
                      "Q, K, V, O are N×d")


# --- 05: one step of 1-pass attention ---------------------------------------------------------

def one_pass_step_solution(o, m, l, x, v_j):
    """After key j, for every row: o (rows, d), m and l (rows,), the new score x (rows,) and
    v_j (d,). Returns (o′, m′, l′): o′ is the output over the keys seen so far."""
    m_new = torch.maximum(m, x)
    alpha, p = torch.exp(m - m_new), torch.exp(x - m_new)
    l_new = l * alpha + p
    o_new = o * (l * alpha / l_new)[:, None] + (p / l_new)[:, None] * v_j[None, :]
    return o_new, m_new, l_new


def _one_pass_cases():
    gen = torch.Generator().manual_seed(5)
    cases = []
    for rows, d, first in ((1, 1, True), (4, 3, False), (7, 8, False), (5, 2, True)):
        o = torch.randn(rows, d, generator=gen, dtype=torch.float64)
        m = torch.randn(rows, generator=gen, dtype=torch.float64)
        l = torch.rand(rows, generator=gen, dtype=torch.float64) * 3 + 1
        if first:  # before the first key: o = 0, m = -inf, l = 0
            o, m, l = torch.zeros_like(o), torch.full_like(m, float("-inf")), torch.zeros_like(l)
        x = torch.randn(rows, generator=gen, dtype=torch.float64) * 2
        cases.append((o, m, l, x, torch.randn(d, generator=gen, dtype=torch.float64)))
    return cases


def check_one_pass_step(student):
    return check("one step of 1-pass attention", student, one_pass_step_solution,
                 _one_pass_cases(), rtol=1e-9, atol=1e-12,
                 hint="m′ = max(m, x); rescale the old o by l·e^(m − m′)/l′ and add "
                      "e^(x − m′)/l′ · v_j; l′ = l·e^(m − m′) + e^(x − m′)")


# --- 06: Algorithm 1's rescale update of O, and block sizes for an SRAM -----------------------

def rescale_update_solution(O_i, l_i, m_i, S_ij, V_j):
    """One (j, i) step of FlashAttention v1 (no mask, no dropout).

    O_i (B_r, d), l_i and m_i (B_r,) as read from HBM; S_ij (B_r, B_c) the block's scaled
    scores; V_j (B_c, d). Returns the (O_i, l_i, m_i) to write back.
    """
    m_tilde = S_ij.amax(dim=-1)
    P_tilde = torch.exp(S_ij - m_tilde[:, None])
    l_tilde = P_tilde.sum(dim=-1)
    m_new = torch.maximum(m_i, m_tilde)
    alpha, beta = torch.exp(m_i - m_new), torch.exp(m_tilde - m_new)
    l_new = alpha * l_i + beta * l_tilde
    O_new = ((l_i * alpha)[:, None] * O_i + beta[:, None] * (P_tilde @ V_j)) / l_new[:, None]
    return O_new, l_new, m_new


def _rescale_cases():
    gen = torch.Generator().manual_seed(6)
    cases = []
    for B_r, B_c, d, first in ((1, 1, 1, True), (4, 3, 2, False), (8, 16, 4, False),
                               (3, 5, 8, True)):
        O = torch.randn(B_r, d, generator=gen, dtype=torch.float64)
        l = torch.rand(B_r, generator=gen, dtype=torch.float64) * 4 + 1
        m = torch.randn(B_r, generator=gen, dtype=torch.float64)
        if first:  # the first K/V block: HBM holds O = 0, l = 0, m = -inf
            O, l, m = torch.zeros_like(O), torch.zeros_like(l), torch.full_like(m, float("-inf"))
        S = torch.randn(B_r, B_c, generator=gen, dtype=torch.float64) * 2
        cases.append((O, l, m, S, torch.randn(B_c, d, generator=gen, dtype=torch.float64)))
    return cases


def check_rescale_update(student):
    return check("the rescale update of O (Algorithm 1, lines 9-13)", student,
                 rescale_update_solution, _rescale_cases(), rtol=1e-9, atol=1e-12,
                 hint="m̃ = rowmax(S), P̃ = exp(S − m̃), l̃ = rowsum(P̃); m_new = max(m_i, m̃); "
                      "l_new = e^(m_i − m_new)·l_i + e^(m̃ − m_new)·l̃; O_i ← (l_i·e^(m_i − m_new)"
                      "·O_i + e^(m̃ − m_new)·P̃V_j) / l_new")


def check_block_sizes(student):
    cases = [(98304, 64), (98304, 128), (65536, 64), (1000, 10), (64, 64), (300, 16)]
    return check("block sizes for an SRAM of M elements", student, paper_block_sizes, cases,
                 rtol=0, atol=0,
                 hint="B_c = ⌈M / (4d)⌉ (Q_i, K_j, V_j, O_i must fit); B_r = min(B_c, d); "
                      "math.ceil, not //")
