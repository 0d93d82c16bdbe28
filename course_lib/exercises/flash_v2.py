"""Exercises of notebooks/08_triton_flash_v2.ipynb and 09_hopper.ipynb.

08: the online-softmax step in PyTorch (exp2 domain); then a minimal FlashAttention-2 forward
kernel in Triton, first non-causal (the step, the one division, the masked store), then causal
(bottom-right: which key blocks to visit, the mask, rows that see no key); the kinds of key
blocks the library's kernel distinguishes. 09: how many pipeline stages fit in shared memory;
the two numbers of the softmax/MMA ceiling; an open GPU question (warp specialisation).

The Triton checkers launch the student's kernel themselves (``prepare_forward``), with O
poisoned, on awkward shapes (N_q ≠ N_k, ragged last blocks, rows that see no key), against
``course_lib.reference.attention`` in float64. Wrong answers are the reference kernel with one or
two lines changed (``kernel_variant``): each differs in exactly the lines a student gets wrong.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE
from course_lib.exercises import (
    Exercise,
    Mistake,
    Question,
    Result,
    check,
    check_kernel,
    poisoned,
    register,
)
from course_lib.exercises.sandbox import kernel_variant
from course_lib.reference import attention

LOG2E = 1.0 / math.log(2.0)
BLOCK = 16  # tl.dot needs every dimension >= 16
#: fp32 inputs: exact dots on a GPU too, where a newer Triton (3.9) reads this launch option;
#: Triton 3.6 ignores it (it reads TRITON_F32_DEFAULT), and so does the interpreter (exact fp32)
EXACT_DOTS = {"default_dot_input_precision": "ieee"}
#: Against float64: an fp32 kernel is within 1e-5; on a GPU whose Triton makes fp32 tl.dot TF32
#: (10-bit mantissa), the compiled pass is off by up to about 1e-2, hence the looser bound there
TOL = dict(rtol=1e-4, atol=1e-5) if DEVICE == "cpu" else dict(rtol=3e-2, atol=3e-2)

# =============================================================================================
# 08 (1): the online-softmax step, in PyTorch
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def online_softmax_step(qk, m_i, l_i, acc, v, qk_scale):
    # TODO: return (m_new, l_new, acc_new), rescaling acc by alpha (never dividing)
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def online_softmax_step_solution(qk, m_i, l_i, acc, v, qk_scale):
    """One step of the kernel's loop on a (rows, BLOCK_N) tile of raw scores ``qk`` = q·kᵀ.

    m_i, l_i (rows,) and acc (rows, D) carry the state in the exp2 domain (m_i is the running
    max of qk·qk_scale, with qk_scale = sm_scale·log2 e); v (BLOCK_N, D). Returns the new
    (m_i, l_i, acc): acc is rescaled by α = 2^(m_old − m_new), never divided.
    """
    s = qk * qk_scale
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + p.sum(dim=-1), acc * alpha[:, None] + p @ v


def _step_exp(qk, m_i, l_i, acc, v, qk_scale):
    s = qk * qk_scale
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    alpha = torch.exp(m_i - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l_i * alpha + p.sum(dim=-1), acc * alpha[:, None] + p @ v


def _step_no_rescale(qk, m_i, l_i, acc, v, qk_scale):
    s = qk * qk_scale
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + p.sum(dim=-1), acc + p @ v


def _step_divides(qk, m_i, l_i, acc, v, qk_scale):
    s = qk * qk_scale
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(s - m_new[:, None])
    l_new = l_i * alpha + p.sum(dim=-1)
    return m_new, l_new, (acc * alpha[:, None] + p @ v) / l_new[:, None]


def _step_no_broadcast(qk, m_i, l_i, acc, v, qk_scale):
    s = qk * qk_scale
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(s - m_new)
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
        cases.append(("step", qk, m, l, acc, v, 0.125 * LOG2E))
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (7, 50, 50))
    cases.append(("folded", q, k, v))
    return cases


def _folded(step, q, k, v, block_n=16):
    """O for one head from ``step`` over every key block, then the one division at the end."""
    qk_scale = q.shape[-1] ** -0.5 * LOG2E
    rows, d = q.shape
    m = torch.full((rows,), float("-inf"), dtype=q.dtype)
    l, acc = torch.zeros(rows, dtype=q.dtype), torch.zeros(rows, d, dtype=q.dtype)
    for c0 in range(0, k.shape[0], block_n):
        out = step(q @ k[c0:c0 + block_n].T, m, l, acc, v[c0:c0 + block_n], qk_scale)
        if out is None:
            return None
        m, l, acc = out
    return acc / l[:, None]


def _step_or_folded(step):
    """Case ("step", ...): one call of ``step``; case ("folded", q, k, v): O over all blocks."""
    def run(kind, *args):
        return step(*args) if kind == "step" else _folded(step, *args)
    return run


def _spec_step_or_folded(kind, *args):
    if kind == "step":
        return online_softmax_step_solution(*args)
    q, k, v = args
    return attention(q[None, None], k[None, None], v[None, None])[0, 0]


STEP_HINTS = (
    "the new running max is the larger of the old one and this tile's row max of the scaled "
    "scores; α is the factor that moves what was summed relative to the old max over to the "
    "new one.",
    "everything is in base 2: qk_scale already holds log₂e, so the exponentials are "
    "torch.exp2; m_new needs [:, None] to be subtracted from every score of its row.",
    "l and acc both shrink by α before this tile's share is added. Nothing is divided: the "
    "one division comes after the last tile.",
)


def check_online_softmax_step(student, show: bool = True) -> Result:
    """Step by step against the spec, then folded over all key blocks of a head (and divided
    once at the end) against ``reference.attention``."""
    def describe(case):
        if case[0] == "folded":
            return (f"your step over all key blocks of a head (q {tuple(case[1].shape)}, "
                    f"k {tuple(case[2].shape)}), then O = acc / l")
        return f"one step, qk {tuple(case[1].shape)}, m_i = {case[2][0].item():.3g}, ..."

    return check("online_softmax_step", _step_or_folded(student), _spec_step_or_folded,
                 _step_cases(), hints=STEP_HINTS, rtol=1e-9, atol=1e-12, show=show,
                 describe=describe)


register(Exercise(
    name="online_softmax_step", lesson="08_triton_flash_v2", kind="python",
    writes="one online-softmax step in the exp2 domain (m, l, acc)", lines=4,
    check=check_online_softmax_step, solution=online_softmax_step_solution,
    stub=online_softmax_step,
    mistakes=(Mistake("exp for exp2", _step_exp, "differ"),
              Mistake("acc not rescaled by alpha", _step_no_rescale, "differ"),
              Mistake("divides by l at every step", _step_divides, "differ"),
              Mistake("m_new not broadcast over the row", _step_no_broadcast, "raised")),
    hints=STEP_HINTS))


# =============================================================================================
# 08 (2): a minimal FlashAttention-2 forward kernel, non-causal
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def flash_v2_kernel(Q, K, V, O, sm_scale, N_Q, N_K, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M query rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o_ptrs = O + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    K += pid_bh * N_K * HEAD_DIM
    V += pid_bh * N_K * HEAD_DIM
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM), once
    qk_scale = ...  # TODO: sm_scale with log2(e) = 1.4426950408889634 folded in
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(0, N_K, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=offs_n[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, kT)  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        s = tl.where(offs_n[None, :] < N_K, qk * qk_scale, float("-inf"))  # no keys past N_K
        m_new = ...  # TODO: the running max of s, row by row
        alpha = ...  # TODO: how much what was summed so far shrinks, now that the max is m_new
        p = ...  # TODO: this block's probabilities, not yet divided by the row sum (base 2)
        l_i = ...  # TODO: the running sum of p
        acc = ...  # TODO: the running sum of p·v (tl.dot)
        m_i = m_new
    o = ...  # TODO: the one division
    ...  # TODO: store o at o_ptrs, only the rows that exist


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _flash_v2_solution(Q, K, V, O, sm_scale, N_Q, N_K, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M query rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o_ptrs = O + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    K += pid_bh * N_K * HEAD_DIM
    V += pid_bh * N_K * HEAD_DIM
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM), once
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(0, N_K, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=offs_n[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, kT)  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        s = tl.where(offs_n[None, :] < N_K, qk * qk_scale, float("-inf"))  # no keys past N_K
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptrs, o, mask=offs_m[:, None] < N_Q)


def prepare_forward(q, k, v, causal=False):
    """One launch: a program per (BLOCK query rows, batch·head); q (BH, N_q, D), k, v (BH, N_k,
    D) contiguous; O poisoned."""
    BH, N_Q, D = q.shape
    o = poisoned(BH, N_Q, D, like=q)
    grid = (triton.cdiv(N_Q, BLOCK), BH)
    args = dict(Q=q, K=k, V=v, O=o, sm_scale=D ** -0.5, N_Q=N_Q, N_K=k.shape[1], HEAD_DIM=D,
                BLOCK_M=BLOCK, BLOCK_N=BLOCK, **EXACT_DOTS)
    return grid, args, o


def _forward_spec(q, k, v, causal=False):
    """softmax(QKᵀ/√D)·V per (batch·head), in float64 (``reference.attention``)."""
    return attention(q.double()[:, None], k.double()[:, None], v.double()[:, None],
                     causal=causal)[:, 0]


def _forward_cases(causal):
    gen = torch.Generator().manual_seed(80 + causal)
    shapes = ((1, 16, 16, 16), (2, 37, 50, 16), (1, 50, 23, 16), (1, 20, 7, 32))
    if causal:  # N_k − N_q > BLOCK_M: a bound hi without the offset stops keys short
        shapes = shapes[:1] + ((1, 16, 60, 16),) + shapes[1:]
    return [tuple(torch.randn(bh, n, d, generator=gen) * s
                  for n, s in ((n_q, 1.5), (n_k, 1.0), (n_k, 1.0))) + (causal,)
            for bh, n_q, n_k, d in shapes]


def _describe_forward(case):
    q, k = case[0], case[1]
    return f"B·H = {q.shape[0]}, N_q = {q.shape[1]}, N_k = {k.shape[1]}, D = {q.shape[2]}"


FORWARD_HINTS = (
    "m_new is the larger of the running max and this block's row max of s. Everything summed "
    "so far is relative to the old max: α is the factor that moves it to the new one.",
    "base 2 throughout: qk_scale holds log₂e, so p and α are powers of 2 (tl.math.exp2), and "
    "a row vector like m_new needs [:, None] to meet a (BLOCK_M, BLOCK_N) tile.",
    "l_i and acc both shrink by α before this block's share is added; acc's share is a "
    "matrix product on the tensor cores (tl.dot).",
    "the one division comes after the loop, each row by its own l. The store then needs the "
    "same row mask as the load of q: rows past N_Q belong to no query.",
)


def check_flash_v2(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` forward; against attention() in float64, non-causal,
    N_q ≠ N_k both ways, ragged last blocks, O poisoned."""
    return check_kernel("flash_v2_kernel", kernel, prepare_forward, _forward_spec,
                        _forward_cases(False), hints=FORWARD_HINTS, **TOL,
                        show=show, describe=_describe_forward)


register(Exercise(
    name="flash_v2_kernel", lesson="08_triton_flash_v2", kind="triton",
    writes="a minimal FlashAttention-2 forward: the exp2 step, one division, the masked store",
    lines=8, check=check_flash_v2, solution=_flash_v2_solution, stub=flash_v2_kernel,
    extra=(prepare_forward,),
    mistakes=(
        Mistake("exp for exp2", kernel_variant(
            _flash_v2_solution, ("alpha = tl.math.exp2(", "alpha = tl.exp("),
            ("p = tl.math.exp2(", "p = tl.exp(")), "values differ"),
        Mistake("qk_scale without log2(e)", kernel_variant(
            _flash_v2_solution, ("sm_scale * 1.4426950408889634", "sm_scale")),
            "values differ"),
        Mistake("acc not rescaled by alpha", kernel_variant(
            _flash_v2_solution, ("acc * alpha[:, None] + ", "acc + ")), "values differ"),
        Mistake("never divides by l", kernel_variant(
            _flash_v2_solution, ("o = acc / l_i[:, None]", "o = acc")), "values differ"),
        Mistake("divides at every step, and again at the end", kernel_variant(
            _flash_v2_solution, ("acc = acc * alpha[:, None] + tl.dot(p, v)",
                                 "acc = (acc * alpha[:, None] + tl.dot(p, v)) / l_i[:, None]")),
            "values differ"),
        Mistake("the store without its mask", kernel_variant(
            _flash_v2_solution, ("tl.store(o_ptrs, o, mask=offs_m[:, None] < N_Q)",
                                 "tl.store(o_ptrs, o)")), "tl.store out of bounds"),
    ),
    hints=FORWARD_HINTS))


# =============================================================================================
# 08 (3): the same kernel, causal (bottom-right), with rows that see no key
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def flash_v2_causal_kernel(Q, K, V, O, sm_scale, N_Q, N_K, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M query rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o_ptrs = O + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    K += pid_bh * N_K * HEAD_DIM
    V += pid_bh * N_K * HEAD_DIM
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM), once
    qk_scale = ...  # TODO: as in exercise 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    offset = N_K - N_Q  # bottom-right: query i sees key j iff j <= i + offset
    hi = ...  # TODO: one past the last key that some row of this block sees
    for start_n in range(0, hi, BLOCK_N):  # the key blocks from hi on are skipped
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=offs_n[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, kT)  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        visible = ...  # TODO: (BLOCK_M, BLOCK_N), True where query offs_m sees key offs_n
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = ...  # TODO: as in exercise 2
        m_ref = ...  # TODO: what p and alpha subtract; finite even in a row that saw no key yet
        alpha = ...  # TODO: as in exercise 2, relative to m_ref
        p = ...  # TODO: as in exercise 2, relative to m_ref
        l_i = ...  # TODO: as in exercise 2
        acc = ...  # TODO: as in exercise 2
        m_i = m_new
    o = ...  # TODO: the one division; O = 0 in a row that saw no key (l_i = 0), never NaN
    ...  # TODO: store o, as in exercise 2


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _flash_v2_causal_solution(Q, K, V, O, sm_scale, N_Q, N_K, HEAD_DIM: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M query rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o_ptrs = O + pid_bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    K += pid_bh * N_K * HEAD_DIM
    V += pid_bh * N_K * HEAD_DIM
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM), once
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    offset = N_K - N_Q  # bottom-right: query i sees key j iff j <= i + offset
    hi = tl.minimum(start_m + BLOCK_M + offset, N_K)
    for start_n in range(0, hi, BLOCK_N):  # the key blocks from hi on are skipped
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=offs_n[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, kT)  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        visible = offs_n[None, :] <= offs_m[:, None] + offset
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptrs, o, mask=offs_m[:, None] < N_Q)


def prepare_causal(q, k, v, causal=True):
    """The launch of ``prepare_forward``, for the causal kernel."""
    return prepare_forward(q, k, v, causal)


CAUSAL_HINTS = (
    "bottom-right: query i sees key j iff j ≤ i + N_K − N_Q, which is not the lower triangle "
    "j ≤ i when N_q ≠ N_k. `visible` compares a column of row indices with a row of key "
    "indices. For hi: which row of the block sees the most keys, and which is its last one?",
    "a row of the block that has seen no key yet has m = −inf, and 2^(−inf − (−inf)) is NaN. "
    "Subtract a finite number in such rows instead (their p and α come out 0 either way).",
    "a row that sees no key at all ends with l_i = 0 and acc = 0: divide by something other "
    "than 0 in those rows, so that O = 0 there.",
)

CAUSAL_NUDGES = {
    "NaN: never written": "NaN in rows that see no key (N_q > N_k)? Follow one such row "
                          "through your step: m stays −inf, and what does 2^(−inf − (−inf)) "
                          "give? And l_i stays 0: what does the division give?",
}


def check_flash_v2_causal(kernel, show: bool = True) -> Result:
    """``kernel``: your causal ``@triton.jit`` forward; against attention(causal=True) in
    float64, bottom-right, N_q ≠ N_k both ways (rows that see no key), O poisoned."""
    return check_kernel("flash_v2_causal_kernel", kernel, prepare_causal,
                        lambda q, k, v, causal: _forward_spec(q, k, v, causal),
                        _forward_cases(True), hints=CAUSAL_HINTS, **TOL,
                        show=show, describe=_describe_forward, nudges=CAUSAL_NUDGES)


register(Exercise(
    name="flash_v2_causal_kernel", lesson="08_triton_flash_v2", kind="triton",
    writes="the causal kernel: the key blocks to visit, the bottom-right mask, no NaN",
    lines=10, check=check_flash_v2_causal, solution=_flash_v2_causal_solution,
    stub=flash_v2_causal_kernel, extra=(prepare_forward,),
    mistakes=(
        Mistake("top-left causal (j <= i)", kernel_variant(
            _flash_v2_causal_solution, ("offs_m[:, None] + offset\n", "offs_m[:, None]\n")),
            "values differ"),
        Mistake("< for <=", kernel_variant(
            _flash_v2_causal_solution, ("offs_n[None, :] <= offs_m", "offs_n[None, :] < offs_m")),
            "values differ"),
        Mistake("hi without the offset: stops at the top-left diagonal", kernel_variant(
            _flash_v2_causal_solution, ("start_m + BLOCK_M + offset", "start_m + BLOCK_M")),
            "values differ"),
        Mistake("stops at the keys of the block's first row", kernel_variant(
            _flash_v2_causal_solution, ("start_m + BLOCK_M + offset", "start_m + 1 + offset")),
            "values differ"),
        Mistake("subtracts m = -inf in rows that saw no key", kernel_variant(
            _flash_v2_causal_solution,
            ('m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_ref = m_new")), "NaN"),
        Mistake("divides by l = 0", kernel_variant(
            _flash_v2_causal_solution,
            ("acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]", "acc / l_i[:, None]")), "NaN"),
    ),
    hints=CAUSAL_HINTS))


# =============================================================================================
# 08 (4): the kinds of key blocks
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def block_kinds(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    # TODO: one of "skipped", "unmasked", "masked" per key block
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def block_kinds_solution(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    """The kind of every key block of the causal (bottom-right) Q block whose first row is
    ``start_m``: what ``flash_v2._causal_bounds`` decides."""
    offset = N_k - N_q  # query i sees key j iff j <= i + offset
    first_row, last_row = start_m, min(start_m + BLOCK_M, N_q) - 1
    kinds = []
    for start_n in range(0, N_k, BLOCK_N):
        last_key = start_n + BLOCK_N - 1
        if start_n > last_row + offset:  # not even the last row sees the block's first key
            kinds.append("skipped")
        elif last_key <= first_row + offset and last_key < N_k:  # all rows see all its keys
            kinds.append("unmasked")
        else:
            kinds.append("masked")
    return kinds


def _kinds_top_left(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    last_row = min(start_m + BLOCK_M, N_q) - 1
    kinds = []
    for start_n in range(0, N_k, BLOCK_N):
        last_key = start_n + BLOCK_N - 1
        if start_n > last_row:
            kinds.append("skipped")
        elif last_key <= start_m and last_key < N_k:
            kinds.append("unmasked")
        else:
            kinds.append("masked")
    return kinds


def _kinds_strict(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    offset = N_k - N_q
    last_row = min(start_m + BLOCK_M, N_q) - 1
    kinds = []
    for start_n in range(0, N_k, BLOCK_N):
        last_key = start_n + BLOCK_N - 1
        if start_n >= last_row + offset:
            kinds.append("skipped")
        elif last_key < start_m + offset:
            kinds.append("unmasked")
        else:
            kinds.append("masked")
    return kinds


def _kinds_last_row_for_unmasked(start_m, N_q, N_k, BLOCK_M, BLOCK_N):
    offset = N_k - N_q
    last_row = min(start_m + BLOCK_M, N_q) - 1
    kinds = []
    for start_n in range(0, N_k, BLOCK_N):
        last_key = start_n + BLOCK_N - 1
        if start_n > last_row + offset:
            kinds.append("skipped")
        elif last_key <= last_row + offset and last_key < N_k:
            kinds.append("unmasked")
        else:
            kinds.append("masked")
    return kinds


KINDS = ("skipped", "unmasked", "masked")


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


KINDS_HINTS = (
    "bottom-right: query row i sees key j iff j ≤ i + N_k − N_q. In one Q block, which row "
    "sees the fewest keys, and which the most?",
    "a key block is skipped when not even the row that sees the most keys sees its first key; "
    "unmasked when even the row that sees the fewest sees its last key; masked otherwise.",
    "the message shows kinds as codes: 0 skipped, 1 unmasked, 2 masked. Try the failing case "
    "by hand on a small grid of rows and keys.",
)


def check_block_kinds(student, show: bool = True) -> Result:
    """Against the kinds of ``analysis.flash_v2.key_block_kinds`` (the kernel's arithmetic)."""
    from course_lib.analysis.flash_v2 import key_block_kinds

    def spec(*args):
        return key_block_kinds(*args, True)

    cases = [(0, 64, 64, 16, 16), (48, 64, 64, 16, 16), (32, 100, 100, 32, 16),
             (96, 100, 100, 32, 16), (0, 30, 100, 32, 16), (64, 130, 60, 64, 32),
             (0, 130, 60, 64, 32), (128, 130, 60, 64, 32), (256, 1000, 1000, 128, 64),
             (896, 1000, 1000, 128, 64), (0, 20, 37, 16, 16), (16, 41, 40, 16, 16)]
    return check("block_kinds", _codes(student), spec, cases, hints=KINDS_HINTS, rtol=0,
                 atol=0, show=show, describe=lambda c: "start_m={}, N_q={}, N_k={}, "
                 "BLOCK_M={}, BLOCK_N={}; kinds as codes: {}".format(
                     *c, ", ".join(f"{i} {k}" for i, k in enumerate(KINDS))))


register(Exercise(
    name="block_kinds", lesson="08_triton_flash_v2", kind="python",
    writes="skipped / unmasked / masked for each key block of a causal Q block", lines=8,
    check=check_block_kinds, solution=block_kinds_solution, stub=block_kinds,
    mistakes=(Mistake("top-left causal", _kinds_top_left, "values differ"),
              Mistake("< for <=", _kinds_strict, "values differ"),
              Mistake("unmasked judged by the last row", _kinds_last_row_for_unmasked,
                      "values differ")),
    hints=KINDS_HINTS))


# =============================================================================================
# 09 (1): pipeline stages in shared memory
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def max_stages(BLOCK_M, BLOCK_N, D, budget_bytes):
    # TODO: the Q tile stays; each stage holds one K and one V tile
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def max_stages_solution(BLOCK_M, BLOCK_N, D, budget_bytes):
    """The most K/V stages (fp16 K and V tiles per stage) that fit beside the Q tile."""
    q_tile = BLOCK_M * D * 2  # fp16: 2 bytes an element; Q stays for the whole loop
    stage = 2 * BLOCK_N * D * 2  # one K tile and one V tile
    return max(0, (budget_bytes - q_tile) // stage)


def _stages_no_q(BLOCK_M, BLOCK_N, D, budget_bytes):
    return budget_bytes // (2 * BLOCK_N * D * 2)


def _stages_k_only(BLOCK_M, BLOCK_N, D, budget_bytes):
    return max(0, (budget_bytes - BLOCK_M * D * 2) // (BLOCK_N * D * 2))


def _stages_negative(BLOCK_M, BLOCK_N, D, budget_bytes):
    return (budget_bytes - BLOCK_M * D * 2) // (2 * BLOCK_N * D * 2)


def _stages_one_byte(BLOCK_M, BLOCK_N, D, budget_bytes):
    return max(0, (budget_bytes - BLOCK_M * D) // (2 * BLOCK_N * D))


STAGES_HINTS = (
    "count bytes: the Q tile is loaded once and stays in shared memory for the whole loop; "
    "each pipeline stage holds one K tile and one V tile, BLOCK_N × D each.",
    "fp16 is 2 bytes an element. Stages come in whole numbers (floor division), and none at "
    "all when the Q tile alone overflows the budget.",
)


def check_max_stages(student, show: bool = True) -> Result:
    kib = 1024
    cases = [(128, 64, 64, 228 * kib), (128, 128, 128, 227 * kib), (128, 64, 128, 227 * kib),
             (64, 64, 256, 227 * kib), (128, 128, 256, 227 * kib), (64, 32, 64, 99 * kib),
             (128, 128, 128, 163 * kib), (256, 64, 256, 64 * kib)]
    return check("max_stages", student, max_stages_solution, cases, hints=STAGES_HINTS, rtol=0,
                 atol=0, show=show, describe=lambda c: "BLOCK_M={}, BLOCK_N={}, D={}, "
                 "budget {} KiB".format(*c[:3], c[3] // kib))


register(Exercise(
    name="max_stages", lesson="09_hopper", kind="python",
    writes="how many K/V pipeline stages fit in shared memory", lines=3,
    check=check_max_stages, solution=max_stages_solution, stub=max_stages,
    mistakes=(Mistake("forgets the Q tile", _stages_no_q, "values differ"),
              Mistake("a stage holds only K", _stages_k_only, "values differ"),
              Mistake("a negative number when Q alone overflows", _stages_negative,
                      "values differ"),
              Mistake("one byte per fp16 element", _stages_one_byte, "values differ")),
    hints=STAGES_HINTS))


# =============================================================================================
# 09 (2): the two numbers
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def two_numbers(D, BLOCK_N):
    # TODO: return (mma_ps, softmax_ps)
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def two_numbers_solution(D, BLOCK_N):
    """(MMA picoseconds, softmax picoseconds) per score element on an H100 SXM, every unit at
    one clock: the clock of the datasheet's dense fp16 rate, 989.4 TFLOP/s / (132 SMs × 4096)."""
    chip = 989.4e12 / 4096  # SM clock cycles per second of the whole chip: 132 SMs × f
    mma_ps = 4 * D / (4096 * chip) * 1e12  # QKᵀ and PV: 2·D FLOPs each, 4096 per SM per clock
    fp32_ops = 1 + 1 + 1 + 0.5 + D / BLOCK_N  # FFMA, max, sum, half a convert, the α rescale
    softmax_ps = (1 / 16 + fp32_ops / 128) / chip * 1e12  # MUFU 16, FP32 128 per SM per clock
    return mma_ps, softmax_ps


def _two_numbers_mufu_at_fp32_rate(D, BLOCK_N):
    mma_ps, _ = two_numbers_solution(D, BLOCK_N)
    return mma_ps, (1 + 3.5 + D / BLOCK_N) / 128 / (989.4e12 / 4096) * 1e12


def _two_numbers_two_clocks(D, BLOCK_N):
    """The softmax from the datasheet's FP32 TFLOP/s, which is quoted at a higher clock than
    its tensor rate: two clocks in one model."""
    mma_ps, _ = two_numbers_solution(D, BLOCK_N)
    fp32_per_s = 67e12 / 2
    return mma_ps, (1 / (fp32_per_s * 16 / 128) + (3.5 + D / BLOCK_N) / fp32_per_s) * 1e12


def _two_numbers_2d_flops(D, BLOCK_N):
    return 2 * D / 989.4e12 * 1e12, two_numbers_solution(D, BLOCK_N)[1]


def _two_numbers_seconds(D, BLOCK_N):
    return tuple(t * 1e-12 for t in two_numbers_solution(D, BLOCK_N))


TWO_NUMBERS_HINTS = (
    "MMA: count the FLOPs one score element costs in QKᵀ and in PV, and divide by the chip's "
    "rate: 4096 FLOPs per SM per clock × 132 SMs × the one clock f of section 5.",
    "softmax: one exp2 at 16 per SM per clock plus the FP32 instructions of section 5's table "
    "(softmax_fp32_ops) at 128 per SM per clock, all at the same clock f as the MMA: "
    "f = 989.4 TFLOP/s / (132 × 4096). The datasheet's FP32 TFLOP/s is quoted at another "
    "clock: mixing the two times the two halves with different clocks.",
    "the answer is in picoseconds: seconds × 1e12.",
)


def check_two_numbers(student, show: bool = True) -> Result:
    """Against ``analysis.hopper.score_costs`` (the model of section 5)."""
    from course_lib.analysis.hopper import score_costs

    def spec(D, BLOCK_N):
        c = score_costs(D, "H100-SXM", BLOCK_N)
        return c["mma_ps"], c["softmax_ps"]

    cases = [(64, 128), (128, 128), (128, 64), (256, 64), (32, 32)]
    return check("two_numbers", student, spec, cases, hints=TWO_NUMBERS_HINTS, rtol=1e-6,
                 atol=0, show=show, describe=lambda c: "D={}, BLOCK_N={}".format(*c),
                 nudges={"softmax_ps:": TWO_NUMBERS_HINTS[1]}, names=("mma_ps", "softmax_ps"))


register(Exercise(
    name="two_numbers", lesson="09_hopper", kind="python",
    writes="MMA and softmax picoseconds per score element on an H100", lines=6,
    check=check_two_numbers, solution=two_numbers_solution, stub=two_numbers,
    mistakes=(Mistake("exp2 at the FP32 rate", _two_numbers_mufu_at_fp32_rate, "softmax_ps:"),
              Mistake("two clocks: the softmax from the datasheet's FP32 TFLOP/s",
                      _two_numbers_two_clocks, "softmax_ps:"),
              Mistake("2·D FLOPs per score", _two_numbers_2d_flops, "mma_ps:"),
              Mistake("seconds, not picoseconds", _two_numbers_seconds, "mma_ps:")),
    hints=TWO_NUMBERS_HINTS))


# =============================================================================================
# 09 (3): an open question, on a GPU
# =============================================================================================
def _stored_tflops(D, causal, N, provider):
    from course_lib.bench.common import load_result

    rows = load_result("attention_fwd")["rows"]
    row = next(r for r in rows if (r["D"], r["causal"], r["N"]) == (D, causal, N))
    return row["results"][provider]["tflops"]


def _costs_64():
    from course_lib.analysis.hopper import score_costs

    return score_costs(64)


_COSTS_64 = _costs_64()
_STORED_64_16K = _stored_tflops(64, False, 16384, "v2-hopper")

register(Question(
    name="q09_warp_specialize", lesson="09_hopper",
    asks="Exercise 3 (open, GPU): does tl.range(..., warp_specialize=True) in the Hopper "
         "kernel's key loop pay, and does a newer Triton move D = 64 past section 5's "
         "no-overlap line?",
    answer=(
        "There is no stored number to compare with: the answer is a measurement, and how to "
        "make it is the worked part.\n\n"
        "1. Copy `_fwd_inner_tma` and the kernel into a module of your own, and change only the "
        "key loop to `for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True)`. With "
        "Triton 3.6 it did not compile with 4 warps (appendix 09a, section 6): use 8, and give "
        "the original the same fixed config, so that the loop is the only difference.\n"
        "2. Time both in one process, in interleaved rounds (A, B, A, B, ...), median per "
        "kernel, at D = 64 and 128 and N = 4k to 16k, causal and not. Single runs of one config "
        "vary by 5 to 10%: a gain smaller than that needs the paired rounds to be believed.\n"
        "3. Compare with the two lines of section 5: score_costs(64)['serial_tflops'] ≈ "
        f"{_COSTS_64['serial_tflops']:.0f} TFLOP/s (no overlap) and "
        f"score_costs(64)['overlapped_tflops'] ≈ {_COSTS_64['overlapped_tflops']:.0f} "
        "(perfect overlap).\n\n"
        "What the course measured: with Triton 3.6 on an H100, warp specialisation compiled "
        "only with 8 warps and did not beat the plain kernel. Since the pinned max (section 6) "
        "the plain kernel already runs above the no-overlap line at D = 64 "
        f"({_STORED_64_16K:.0f} TFLOP/s at N = 16k in course_lib/data/attention_fwd.json): two "
        "programs per SM overlap one's exp2 with the other's MMA. So the question becomes "
        "whether warp specialisation adds to that. It can only if the compiler builds "
        "FlashAttention-3's schedule, two consumer warp groups taking turns at softmax and "
        "GEMM, and not only a producer warp that issues the loads, which the TMA pipeline "
        "already hides. Look at the result per head dim: at D = 128 the MMA is the larger "
        "number, and overlap can lift the kernel at most to the tensor-core peak.")))
