"""Exercises of notebooks/07_triton_flash_v1.ipynb: FlashAttention v1's block update in Triton,
and the bytes v1's carried state costs.

* ``flash_v1_kernel`` (Triton): a minimal v1 kernel (non-causal, H_kv = H, contiguous
  (B, H, N, D) fp32 tensors, one program per (batch, head)). The skeleton walks Algorithm 1's
  loops (K/V blocks outside, Q blocks inside), loads K_j, V_j, Q_i and the running O_i, l_i, m_i
  from HBM and stores them back; the student writes the update between the loads and the
  stores: the block's scores, m̃, P̃, l̃, the new m and l, and O_i rescaled. The checker runs it
  on N_q != N_k, neither a multiple of the blocks (BLOCK 16), several Q blocks sharing each K/V
  block, with O, l, m poisoned, against ``course_lib.reference.attention`` (and the row max and
  sum of the scores for l and m). The library's full kernel (``course_lib.kernels.flash_v1``)
  is the same loop plus what the lesson shows after the exercise.
* ``v1_state_bytes`` (Python): the bytes of O_acc, l and m the full kernel moves. The spec is the
  IO model's count of ``course_lib.kernels.flash_v1`` (``flash_v1_io(..., kernel_bookkeeping=
  True)``): the fp32 O_acc, l and m that go back to HBM after every step but a row block's last,
  and come back before every step but its first.
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
from course_lib.iomodel.attention import flash_v1_io
from course_lib.reference import attention

BLOCK = 16  # BLOCK_M = BLOCK_N: tl.dot needs every dimension >= 16


# --- what the notebook shows (tests/test_exercises.py checks the notebook has this text) ----
@triton.jit
def flash_v1_kernel(Q, K, V, Out, L, M, N_Q, N_K, sm_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per (batch, head). Q, Out: (B, H, N_Q, HEAD_DIM); K, V: (B, H, N_K, HEAD_DIM);
    # L, M: (B, H, N_Q); all contiguous fp32. Out, L, M are Algorithm 1's O, l, m in HBM.
    pid = tl.program_id(0)
    q_base, o_base = Q + pid * N_Q * HEAD_DIM, Out + pid * N_Q * HEAD_DIM
    k_base, v_base = K + pid * N_K * HEAD_DIM, V + pid * N_K * HEAD_DIM
    l_base, m_base = L + pid * N_Q, M + pid * N_Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(0, tl.cdiv(N_K, BLOCK_N)):  # outer loop: K/V block j, loaded once
        cols = j * BLOCK_N + offs_n
        col_ok = cols < N_K  # the last K/V block may hang over N_K
        kv_offs = cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=col_ok[:, None], other=0.0)  # (BLOCK_N, HEAD_DIM)
        v = tl.load(v_base + kv_offs, mask=col_ok[:, None], other=0.0)  # (BLOCK_N, HEAD_DIM)
        for i in range(0, tl.cdiv(N_Q, BLOCK_M)):  # inner loop: every Q block
            rows = i * BLOCK_M + offs_m
            row_ok = rows < N_Q
            q_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(q_base + q_offs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
            # O_i, l_i, m_i from HBM; before the first K/V block (j = 0): 0, 0 and -inf
            seen = row_ok & (j > 0)
            o_i = tl.load(o_base + q_offs, mask=seen[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
            l_i = tl.load(l_base + rows, mask=seen, other=0.0)  # (BLOCK_M,)
            m_i = tl.load(m_base + rows, mask=seen, other=float("-inf"))  # (BLOCK_M,)

            s = ...  # TODO: S_ij = sm_scale · Q_i K_jᵀ (BLOCK_M, BLOCK_N); keys past N_K: no weight
            m_tilde = ...  # TODO: m̃, the max of each row of S_ij
            p = ...  # TODO: P̃ = exp(S_ij − m̃)
            l_tilde = ...  # TODO: l̃, the sum of each row of P̃
            m_new = ...  # TODO: the running max after this block
            l_new = ...  # TODO: the running sum after this block
            o_new = ...  # TODO: O_i rescaled and renormalised (Algorithm 1, line 12)

            tl.store(o_base + q_offs, o_new, mask=row_ok[:, None])  # back to HBM
            tl.store(l_base + rows, l_new, mask=row_ok)
            tl.store(m_base + rows, m_new, mask=row_ok)
        tl.debug_barrier()  # the next K/V block reads what this one wrote


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _flash_v1_solution(Q, K, V, Out, L, M, N_Q, N_K, sm_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    q_base, o_base = Q + pid * N_Q * HEAD_DIM, Out + pid * N_Q * HEAD_DIM
    k_base, v_base = K + pid * N_K * HEAD_DIM, V + pid * N_K * HEAD_DIM
    l_base, m_base = L + pid * N_Q, M + pid * N_Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(0, tl.cdiv(N_K, BLOCK_N)):  # outer loop: K/V block j, loaded once
        cols = j * BLOCK_N + offs_n
        col_ok = cols < N_K  # the last K/V block may hang over N_K
        kv_offs = cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=col_ok[:, None], other=0.0)  # (BLOCK_N, HEAD_DIM)
        v = tl.load(v_base + kv_offs, mask=col_ok[:, None], other=0.0)  # (BLOCK_N, HEAD_DIM)
        for i in range(0, tl.cdiv(N_Q, BLOCK_M)):  # inner loop: every Q block
            rows = i * BLOCK_M + offs_m
            row_ok = rows < N_Q
            q_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(q_base + q_offs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
            # O_i, l_i, m_i from HBM; before the first K/V block (j = 0): 0, 0 and -inf
            seen = row_ok & (j > 0)
            o_i = tl.load(o_base + q_offs, mask=seen[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
            l_i = tl.load(l_base + rows, mask=seen, other=0.0)  # (BLOCK_M,)
            m_i = tl.load(m_base + rows, mask=seen, other=float("-inf"))  # (BLOCK_M,)

            s = tl.dot(q, tl.trans(k)) * sm_scale
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_tilde = tl.max(s, axis=1)
            p = tl.exp(s - m_tilde[:, None])
            l_tilde = tl.sum(p, axis=1)
            m_new = tl.maximum(m_i, m_tilde)
            alpha = tl.exp(m_i - m_new)
            beta = tl.exp(m_tilde - m_new)
            l_new = alpha * l_i + beta * l_tilde
            pv = tl.dot(p, v)
            o_new = ((l_i * alpha)[:, None] * o_i + beta[:, None] * pv) / l_new[:, None]

            tl.store(o_base + q_offs, o_new, mask=row_ok[:, None])  # back to HBM
            tl.store(l_base + rows, l_new, mask=row_ok)
            tl.store(m_base + rows, m_new, mask=row_ok)
        tl.debug_barrier()  # the next K/V block reads what this one wrote


# Each registered wrong answer is the reference with one slip (``kernel_variant``).
_flash_v1_no_beta = kernel_variant(_flash_v1_solution, ("beta[:, None] * pv", "pv"))
_flash_v1_no_alpha = kernel_variant(
    _flash_v1_solution, ("(l_i * alpha)[:, None] * o_i", "l_i[:, None] * o_i"))
_flash_v1_padded_keys = kernel_variant(
    _flash_v1_solution, ('s = tl.where(col_ok[None, :], s, float("-inf"))', "pass"))
_flash_v1_unshifted_exp = kernel_variant(
    _flash_v1_solution, ("tl.exp(s - m_tilde[:, None])", "tl.exp(s)"))
_flash_v1_k_unmasked = kernel_variant(
    _flash_v1_solution, ("k = tl.load(k_base + kv_offs, mask=col_ok[:, None], other=0.0)",
                         "k = tl.load(k_base + kv_offs)"))


def _in_torch(q, k, v):
    return attention(q, k, v)


# --- the checker -----------------------------------------------------------------------------
def prepare_flash_v1(q, k, v):
    """One launch: one program per (batch, head); O, l, m poisoned (the kernel must write
    every row at every step, and read back only what it wrote)."""
    B, H, N_q, D = q.shape
    N_k = k.shape[2]
    out = poisoned(B, H, N_q, D, like=q)
    l_hbm, m_hbm = poisoned(B, H, N_q, like=q), poisoned(B, H, N_q, like=q)
    args = dict(Q=q, K=k, V=v, Out=out, L=l_hbm, M=m_hbm, N_Q=N_q, N_K=N_k, sm_scale=D ** -0.5,
                HEAD_DIM=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return (B * H,), args, (out, l_hbm, m_hbm)


def _spec(q, k, v):
    """O from the course's reference; l and m: each row's max of the scaled scores and its sum
    of exp(S − m), in fp64."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    m = s.amax(dim=-1)
    return attention(q.double(), k.double(), v.double()), torch.exp(s - m[..., None]).sum(-1), m


def _cases():
    """(B, H, N_q, N_k, D): every block hangs over (neither N is a multiple of 16), N_q > N_k
    and N_q < N_k, several Q blocks share every K/V block, one block of each."""
    gen = torch.Generator().manual_seed(7)
    shapes = ((1, 1, 5, 3, 16), (1, 2, 37, 21, 16), (2, 1, 20, 45, 32))
    return [tuple(torch.randn(B, H, n, D, generator=gen) for n in (N_q, N_k, N_k))
            for B, H, N_q, N_k, D in shapes]


def _describe(case) -> str:
    (B, H, N_q, D), N_k = case[0].shape, case[1].shape[2]
    return f"B = {B}, H = {H}, N_q = {N_q}, N_k = {N_k}, D = {D}, outputs (O, l, m)"


KERNEL_HINTS = (
    "follow Algorithm 1, lines 9 to 12 (lesson 06, section 1): first the block's own summary "
    "(m̃, P̃, l̃), then the merge with the running m_i, l_i and O_i read from HBM.",
    "tl.dot(a, b) multiplies (BLOCK_M, HEAD_DIM) by (HEAD_DIM, BLOCK_N): K_j is loaded as "
    "(BLOCK_N, HEAD_DIM), tl.trans turns it. tl.max(x, axis=1) and tl.sum(x, axis=1) reduce "
    "each row to a (BLOCK_M,) vector; x[:, None] makes it a column that broadcasts over a row.",
    "the last K/V block hangs over N_K: its missing keys were loaded as 0, so their score is 0 "
    "and e^0 is not 0. A score of −∞ gets weight 0; tl.where(condition, x, y) picks per "
    "element, and col_ok[None, :] is a row of conditions that broadcasts down the block.",
    "two factors move old numbers to the new max: the old sum l_i and the old O_i were both "
    "computed against m_i, this block's l̃ and P̃V_j against m̃. Both appear in l_new and in "
    "O_i, and O_i is divided by the new sum at the end (it stays normalised).",
)
KERNEL_NUDGES = {
    " O:": "O is off: check the O_i line first: each of its two terms is scaled to the new "
              "max, and the sum is divided by l_new.",
    " l:": "O matches here, l does not: the l stored with m must be the sum of e^(S − m). "
              "Check P̃ (is the block max subtracted?) and l_new (is each sum moved to the new "
              "max?).",
    " m:": "m is off: the running max is the larger of the old m_i and this block's m̃.",
}


def check_flash_v1_kernel(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` flash_v1_kernel; O, l and m against the reference on
    ragged shapes with BLOCK 16. On a GPU, tl.dot of fp32 runs in TF32: the tolerance follows."""
    tol = 1e-5 if DEVICE != "cuda" else 2e-2
    return check_kernel("flash_v1_kernel", kernel, prepare_flash_v1, _spec, _cases(),
                        hints=KERNEL_HINTS, rtol=tol, atol=tol, show=show, describe=_describe,
                        nudges=KERNEL_NUDGES, names=("O", "l", "m"))


register(Exercise(
    name="flash_v1_kernel", lesson="07_triton_flash_v1", kind="triton",
    writes="v1's block update: S_ij, m̃, P̃, l̃, m_new, l_new, O_i rescaled", lines=10,
    check=check_flash_v1_kernel, solution=_flash_v1_solution, stub=flash_v1_kernel,
    extra=(prepare_flash_v1,),
    mistakes=(Mistake("O_i without this block's factor e^(m̃ − m_new)", _flash_v1_no_beta,
                      "values differ"),
              Mistake("the old O_i without its factor e^(m_i − m_new)", _flash_v1_no_alpha,
                      "O:"),
              Mistake("no −∞ on the padded keys of the last K/V block", _flash_v1_padded_keys,
                      "values differ"),
              Mistake("P̃ = exp(S_ij), the block max not subtracted", _flash_v1_unshifted_exp,
                      "values differ"),
              Mistake("the K_j load without its mask", _flash_v1_k_unmasked,
                      "tl.load out of bounds"),
              Mistake("an answer in PyTorch, no kernel", _in_torch, "@triton.jit kernel")),
    hints=KERNEL_HINTS))


# --- the price of carrying the state: v1_state_bytes ----------------------------------------
def v1_state_bytes(N, D, block_n):
    # TODO: return the number of bytes
    raise NotImplementedError


def v1_state_bytes_solution(N: int, D: int, block_n: int) -> int:
    """Bytes of O_acc, l, m moved per (batch, head) by flash_attn_v1, non-causal, N_q = N_k = N."""
    return 2 * (math.ceil(N / block_n) - 1) * N * (D + 2) * 4


def _spec_state(N: int, D: int, block_n: int) -> int:
    io = flash_v1_io(N, N, D, 64, block_n, kernel_bookkeeping=True)
    state = ("O_acc", "l", "m")
    return 4 * sum(io[kind].get(name, 0) for kind in ("reads", "writes") for name in state)


STATE_HINTS = (
    "look at the masks of section 3: at which step of a row block is nothing read back, and "
    "at which step does the result go to the output instead of the scratch?",
    "the state of one row is O_acc (D numbers), l and m, all fp32: 4 bytes each.",
    "a row block meets ⌈N / BLOCK_N⌉ K/V blocks, one step each: count the hand-overs between "
    "consecutive steps. Each is one write and, one step later, one read.",
)


def check_v1_state_bytes(student, show: bool = True) -> Result:
    cases = [(64, 64, 64), (128, 64, 64), (1024, 64, 64), (1000, 128, 64), (97, 32, 16),
             (16384, 128, 32)]
    return check("v1_state_bytes", student, _spec_state, cases, hints=STATE_HINTS, rtol=0,
                 atol=0, show=show, describe=lambda c: f"N = {c[0]}, D = {c[1]}, "
                                                        f"block_n = {c[2]}")


register(Exercise(
    name="v1_state_bytes", lesson="07_triton_flash_v1", kind="python",
    writes="the bytes of O_acc, l, m the v1 kernel carries through HBM", lines=1,
    check=check_v1_state_bytes, solution=v1_state_bytes_solution, stub=v1_state_bytes,
    mistakes=(Mistake("a round trip at every step, T_c instead of T_c − 1",
                      lambda N, D, bn: 2 * math.ceil(N / bn) * N * (D + 2) * 4, "differ"),
              Mistake("O_acc only, no l and m",
                      lambda N, D, bn: 2 * (math.ceil(N / bn) - 1) * N * D * 4, "differ"),
              Mistake("N // block_n for the number of K/V blocks",
                      lambda N, D, bn: 2 * (N // bn - 1) * N * (D + 2) * 4, "differ"),
              Mistake("the writes only",
                      lambda N, D, bn: (math.ceil(N / bn) - 1) * N * (D + 2) * 4, "differ")),
    hints=STATE_HINTS))


register(Question(
    name="q07_fp32_scratch", lesson="07_triton_flash_v1",
    asks="Your kernel keeps the running O_i in Out itself, in fp32. The library's kernel "
         "returns O in q's dtype (fp16 or bf16), yet carries O_i between steps in a separate "
         "fp32 scratch O_acc. Why not carry it in Out, in fp16?",
    answer="Every step reads O_i back, rescales it and writes it again: T_c = ⌈N_k/BLOCK_N⌉ "
           "round trips per row block. Stored in fp16, O_i would be rounded to 11 significant "
           "bits at every one of them, and those roundings add up, while the output itself "
           "shrinks as more keys are averaged: the error grows relative to O with N_k (with "
           "64-key blocks, a simulation of the loop gives several times the error of an fp32 "
           "scratch at N_k = 1024, over ten times at 16k). In fp32 each rounding is 2^-24, and "
           "only the last step rounds, once, to q's dtype, as standard attention does. The "
           "price is bytes: O_acc costs 4 bytes per number per round trip instead of 2, one "
           "reason v1's carried state dominates its traffic (the exercise at the end of this "
           "lesson counts it)."))
