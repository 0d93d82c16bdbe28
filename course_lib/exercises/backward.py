"""Exercises of notebooks/10_backward.ipynb: the backward formulas, delta, the HBM count, and
the backward's preprocessing kernel in Triton.

Reference solutions are here (tested in tests/test_flash_bwd.py through the checkers);
the notebook shows only the stubs.

1. ``check_attention_backward``: dQ, dK, dV of one head from the five formulas;
2. ``check_delta``: delta = rowsum(dO ∘ O), which equals rowsum(P ∘ dP) without P;
3. ``check_standard_backward_elements``: Algorithm 3's HBM accesses in closed form;
4. ``check_delta_kernel``: delta as a Triton kernel (the backward's first kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE
from course_lib.exercises import Result, check

BACKWARD_HINT = ("S = scale·q kᵀ, P = softmax(S, dim=-1), then dV = Pᵀ dO, dP = dO Vᵀ, "
                 "delta = rowsum(P ∘ dP) (keepdim), dS = P ∘ (dP - delta), dQ = scale·dS K, "
                 "dK = scale·dSᵀ Q; return (dq, dk, dv)")
DELTA_HINT = "(do * o).sum(dim=-1): one number per query row, no N × N matrix needed"
COUNT_HINT = ("count each step's reads and writes: 1) read P, dO, write dV; 2) read dO, V, "
              "write dP; 3) read P, dP, write dS; 4) read dS, K, write dQ; 5) read dS, Q, write "
              "dK. P, dP, dS are N×N, the rest N×d")
KERNEL_HINT = ("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M); offs_d = tl.arange(0, HEAD_DIM); "
               "load the (BLOCK_M, HEAD_DIM) tiles of O and dO with mask offs_m[:, None] < N "
               "(as float32), tl.sum(o * do, axis=1), store with mask offs_m < N")


# ---------------------------------------------------------------------------------------------
# 1. the five formulas
# ---------------------------------------------------------------------------------------------
def attention_backward_solution(q, k, v, do, sm_scale):
    """Gradients of O = softmax(sm_scale·q kᵀ) v for one head: q, do (N_q, d); k, v (N_k, d)."""
    p = torch.softmax(sm_scale * q @ k.T, dim=-1)       # (N_q, N_k)
    dv = p.T @ do                                        # (N_k, d)
    dp = do @ v.T                                        # (N_q, N_k)
    delta = (p * dp).sum(-1, keepdim=True)               # (N_q, 1)
    ds = p * (dp - delta)                                # (N_q, N_k)
    dq = sm_scale * ds @ k                               # (N_q, d)
    dk = sm_scale * ds.T @ q                             # (N_k, d)
    return dq, dk, dv


def _autograd_backward(q, k, v, do, sm_scale):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = torch.softmax(sm_scale * leaves[0] @ leaves[1].T, dim=-1) @ leaves[2]
    return tuple(torch.autograd.grad(o, leaves, do))


def _backward_cases():
    gen = torch.Generator().manual_seed(10)
    cases = []
    for n_q, n_k, d, scale in ((3, 3, 2, 1.0), (5, 7, 4, 0.5), (16, 9, 8, 8 ** -0.5)):
        q, do = (torch.randn(n_q, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(n_k, d, generator=gen, dtype=torch.float64) for _ in range(2))
        cases.append((q, k, v, do, scale))
    return cases


def check_attention_backward(student) -> Result:
    """``student(q, k, v, do, sm_scale) -> (dq, dk, dv)`` against torch.autograd (fp64)."""
    return check("attention backward", student, _autograd_backward, _backward_cases(),
                 hint=BACKWARD_HINT, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 2. delta without P
# ---------------------------------------------------------------------------------------------
def delta_solution(o, do):
    """delta_i = Σ_d dO_id · O_id, shape (..., N_q)."""
    return (do * o).sum(-1)


def _delta_from_p(o, do, p, v):
    """The definition, with P: rowsum(P ∘ dP), dP = dO Vᵀ (``o`` is P V)."""
    return (p * (do @ v.transpose(-1, -2))).sum(-1)


def _delta_cases():
    gen = torch.Generator().manual_seed(11)
    cases = []
    for n_q, n_k, d in ((4, 6, 3), (9, 5, 8)):
        q, do = (torch.randn(n_q, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(n_k, d, generator=gen, dtype=torch.float64) for _ in range(2))
        p = torch.softmax(q @ k.T, dim=-1)
        cases.append((p @ v, do, p, v))
    return cases


def check_delta(student) -> Result:
    """``student(o, do) -> delta`` equals rowsum(P ∘ dP), computed here with P."""
    return check("delta = rowsum(dO ∘ O)", lambda o, do, p, v: student(o, do), _delta_from_p,
                 _delta_cases(), hint=DELTA_HINT, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 3. Algorithm 3's HBM accesses
# ---------------------------------------------------------------------------------------------
def standard_backward_elements_solution(N, d):
    """Elements Algorithm 3 moves for one head (N_q = N_k = N): 7·N² + 8·N·d."""
    return 7 * N * N + 8 * N * d


def check_standard_backward_elements(student) -> Result:
    from course_lib.iomodel.backward import standard_backward_io

    return check("standard backward HBM accesses", student,
                 lambda N, d: standard_backward_io(N, N, d)["elements"],
                 [(4, 2), (1024, 64), (4096, 128)], hint=COUNT_HINT, rtol=0, atol=0.5)


# ---------------------------------------------------------------------------------------------
# 4. the preprocessing kernel in Triton
# ---------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(O, DO, Delta, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = pid_bh.to(tl.int64) * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + ptrs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh * N + offs_m, tl.sum(o * do, axis=1), mask=offs_m < N)


def delta_triton_solution(o, do, block_m=16):
    """delta (B, H, N) fp32 of contiguous o, do (B, H, N, D) with a Triton kernel."""
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=o.device)
    _delta_kernel[(triton.cdiv(N, block_m), B * H)](o.contiguous(), do.contiguous(), delta, N,
                                                    HEAD_DIM=D, BLOCK_M=block_m)
    return delta


def check_delta_kernel(student) -> Result:
    """``student(o, do) -> delta`` (B, H, N) fp32 on the course's device, ragged N included."""
    gen = torch.Generator().manual_seed(12)
    cases = [tuple(torch.randn(B, H, N, D, generator=gen).to(DEVICE) for _ in range(2))
             for B, H, N, D in ((1, 1, 16, 16), (2, 3, 37, 32), (1, 2, 1, 64))]
    return check("delta kernel", student, lambda o, do: (o.float() * do.float()).sum(-1),
                 cases, hint=KERNEL_HINT, rtol=1e-5, atol=1e-5)
