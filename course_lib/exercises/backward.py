"""Exercises of notebooks/10_backward.ipynb, numbered as the notebook numbers them (each sits
beside its material, before the cells that would give its answer): the five formulas, delta
without P, the backward's Triton kernels the student writes, and the HBM count of the standard
backward.

1. ``attention_backward`` (section 1): dQ, dK, dV of one head from the five formulas, against
   autograd;
2. ``delta`` (section 2): rowsum(dO ∘ O), which equals rowsum(P ∘ dP) without P;
3. ``delta_kernel`` (Triton, the warm-up): delta = rowsum(dO ∘ O), one program per BLOCK_M rows;
4. ``dkdv_kernel`` (Triton): one program per K/V block, the Q and dO blocks streamed past; the
   student recomputes P from the saved base-2 lse and writes the four products;
4b. ``one_pass_kernel`` (Triton): the same loop with the fifth product, dQ = τ dS K, added into
   an fp32 dQ by every key block's program with atomic adds (FlashAttention-2's one pass);
5. ``standard_backward_elements`` (section 7): Algorithm 3's HBM accesses in closed form.

The Triton checkers launch the kernel themselves (``prepare_*``) with the outputs poisoned, on
ragged shapes, N_q ≠ N_k, causal rows that see no key; the dK/dV kernel is compared with
torch.autograd through ``course_lib.reference.attention`` in float64. Wrong answers are the
reference kernel with a line changed (``kernel_variant``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.exercises import (
    Exercise,
    Mistake,
    Result,
    check,
    check_kernel,
    poisoned,
    register,
)
from course_lib.exercises.flash_v2 import EXACT_DOTS, LOG2E, TOL
from course_lib.exercises.sandbox import kernel_variant
from course_lib.reference import attention

BLOCK = 16  # tl.dot needs every dimension >= 16


def _heads(*shapes_and_seed):
    """Seeded (B·H, N, D) float32 tensors, one per shape."""
    *shapes, seed = shapes_and_seed
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=gen) for s in shapes)


def _describe_heads(case):
    first = case[0]
    text = f"B·H = {first.shape[0]}, N = {first.shape[1]}, D = {first.shape[2]}"
    if len(case) > 2:  # (q, k, v, do, causal)
        text = (f"B·H = {first.shape[0]}, N_q = {first.shape[1]}, N_k = {case[1].shape[1]}, "
                f"D = {first.shape[2]}, causal = {case[-1]}")
    return text


# =============================================================================================
# 3. the preprocessing kernel: delta = rowsum(dO ∘ O)
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def delta_kernel(O, DO, Delta, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_m = ...  # TODO: the BLOCK_M row indices of this program
    offs_d = tl.arange(0, HEAD_DIM)
    tile = pid_bh * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = ...  # TODO: the (BLOCK_M, HEAD_DIM) tile of O; rows past N read as 0
    do = ...  # TODO: the same tile of dO
    delta = ...  # TODO: one number per row: the sum over d of dO·O
    ...  # TODO: store delta at Delta[pid_bh·N + row], only the rows that exist


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _delta_solution(O, DO, Delta, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)  # which BLOCK_M rows
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tile = pid_bh * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + tile, mask=offs_m[:, None] < N, other=0.0)
    do = tl.load(DO + tile, mask=offs_m[:, None] < N, other=0.0)
    delta = tl.sum(o * do, axis=1)
    tl.store(Delta + pid_bh * N + offs_m, delta, mask=offs_m < N)


def prepare_delta(o, do):
    """One launch: a program per (BLOCK rows, batch·head); o, do (B·H, N, D); delta poisoned."""
    BH, N, D = o.shape
    delta = poisoned(BH, N, like=o)
    grid = (triton.cdiv(N, BLOCK), BH)
    return grid, dict(O=o, DO=do, Delta=delta, N=N, HEAD_DIM=D, BLOCK_M=BLOCK), delta


DELTA_KERNEL_HINTS = (
    "program pid_m owns rows pid_m·BLOCK_M … pid_m·BLOCK_M + BLOCK_M − 1 of its head; `tile` "
    "then addresses a (BLOCK_M, HEAD_DIM) block of O or dO.",
    "the last program hangs over row N: the loads need a row mask (a column, [:, None], to "
    "cover the tile) and other=0.0; the store a mask on the rows alone.",
    "the row sum is tl.sum over the head dimension, axis 1: one number per row.",
)


def check_delta_kernel(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` delta kernel; against (o·do).sum(-1), ragged N."""
    cases = [_heads((1, 16, 16), (1, 16, 16), 12), _heads((3, 37, 32), (3, 37, 32), 13),
             _heads((2, 1, 64), (2, 1, 64), 14)]
    return check_kernel("delta_kernel", kernel, prepare_delta,
                        lambda o, do: (o.double() * do.double()).sum(-1), cases,
                        hints=DELTA_KERNEL_HINTS, rtol=1e-5, atol=1e-5, show=show,
                        describe=_describe_heads)


register(Exercise(
    name="delta_kernel", lesson="10_backward", kind="triton",
    writes="the backward's preprocessing: offsets, masked loads, row sum, masked store",
    lines=5, check=check_delta_kernel, solution=_delta_solution, stub=delta_kernel,
    extra=(prepare_delta,),
    mistakes=(
        Mistake("the store without its mask", kernel_variant(
            _delta_solution, ("delta, mask=offs_m < N)", "delta)")), "tl.store out of bounds"),
        Mistake("the loads without their mask", kernel_variant(
            _delta_solution, ("tl.load(O + tile, mask=offs_m[:, None] < N, other=0.0)",
                              "tl.load(O + tile)"),
            ("tl.load(DO + tile, mask=offs_m[:, None] < N, other=0.0)", "tl.load(DO + tile)")),
            "tl.load out of bounds"),
        Mistake("mask offs_m <= N", kernel_variant(
            _delta_solution, ("delta, mask=offs_m < N)", "delta, mask=offs_m <= N)")),
            "out of bounds"),
        Mistake("the sum over the rows (axis 0)", kernel_variant(
            _delta_solution, ("axis=1", "axis=0")), "case 0"),
        Mistake("the store forgets the head (pid_bh)", kernel_variant(
            _delta_solution, ("Delta + pid_bh * N + offs_m", "Delta + offs_m")), "values differ"),
    ),
    hints=DELTA_KERNEL_HINTS))


# =============================================================================================
# 4. the dK/dV kernel: a K/V block stays on chip, the Q and dO blocks stream past
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE2, Delta, DK, DV, sm_scale, N_Q, N_K, CAUSAL: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # which BLOCK_N keys
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = pid_bh * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    Q += pid_bh * N_Q * HEAD_DIM
    DO += pid_bh * N_Q * HEAD_DIM
    LSE2 += pid_bh * N_Q
    Delta += pid_bh * N_Q
    qk_scale = sm_scale * 1.4426950408889634  # LSE2 is base 2: lse·log2(e)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):  # the Q and dO blocks stream past
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = ...  # TODO: the (BLOCK_M, HEAD_DIM) tile of Q at rows offs_m; rows past N_Q as 0
        do = ...  # TODO: the same tile of dO
        lse2 = ...  # TODO: (BLOCK_M,) the saved lse2 of these rows: P must be 0 past N_Q
        delta = ...  # TODO: (BLOCK_M,) delta of these rows
        qk = ...  # TODO: the raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        p = ...  # TODO: P of this block, recomputed from qk and the saved lse2
        if CAUSAL:  # bottom-right: query i sees key j iff j <= i + N_K - N_Q
            p = ...  # TODO: P with the keys row i does not see set to 0
        dv = ...  # TODO: dv plus this block's Pᵀ dO
        dp = ...  # TODO: dO Vᵀ, (BLOCK_M, BLOCK_N)
        ds = ...  # TODO: P ∘ (dP − delta)
        dk = ...  # TODO: dk plus this block's dSᵀ Q, times sm_scale
    tl.store(DK + kv_ptrs, dk, mask=offs_n[:, None] < N_K)
    tl.store(DV + kv_ptrs, dv, mask=offs_n[:, None] < N_K)


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _dkdv_solution(Q, K, V, DO, LSE2, Delta, DK, DV, sm_scale, N_Q, N_K, CAUSAL: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # which BLOCK_N keys
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = pid_bh * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    Q += pid_bh * N_Q * HEAD_DIM
    DO += pid_bh * N_Q * HEAD_DIM
    LSE2 += pid_bh * N_Q
    Delta += pid_bh * N_Q
    qk_scale = sm_scale * 1.4426950408889634  # LSE2 is base 2: lse·log2(e)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):  # the Q and dO blocks stream past
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + rows, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM)
        do = tl.load(DO + rows, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM)
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < N_Q, other=float("inf"))  # (BLOCK_M,)
        delta = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
        qk = tl.dot(q, tl.trans(k))  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if CAUSAL:  # bottom-right: query i sees key j iff j <= i + N_K - N_Q
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + N_K - N_Q, p, 0.0)
        dv = dv + tl.dot(tl.trans(p), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk = dk + tl.dot(tl.trans(ds), q) * sm_scale
    tl.store(DK + kv_ptrs, dk, mask=offs_n[:, None] < N_K)
    tl.store(DV + kv_ptrs, dv, mask=offs_n[:, None] < N_K)


def _saved_by_forward(q, k, v, do, causal):
    """What the forward and the preprocessing leave for this kernel: lse₂ = lse·log2 e (+inf
    for a row that sees no key, so that its P is 0) and delta = rowsum(dO ∘ O), fp32."""
    o, lse = attention(q.double()[:, None], k.double()[:, None], v.double()[:, None],
                       causal=causal, return_lse=True)
    o, lse = o[:, 0], lse[:, 0]
    lse2 = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse * LOG2E)
    return lse2.float(), (do.double() * o).sum(-1).float()


def prepare_dkdv(q, k, v, do, causal):
    """One launch: a program per (BLOCK keys, batch·head); q, do (B·H, N_q, D), k, v (B·H, N_k,
    D) contiguous; dK and dV poisoned."""
    BH, N_Q, D = q.shape
    N_K = k.shape[1]
    lse2, delta = _saved_by_forward(q, k, v, do, causal)
    dk, dv = poisoned(BH, N_K, D, like=k), poisoned(BH, N_K, D, like=k)
    args = dict(Q=q, K=k, V=v, DO=do, LSE2=lse2, Delta=delta, DK=dk, DV=dv,
                sm_scale=D ** -0.5, N_Q=N_Q, N_K=N_K, CAUSAL=causal, HEAD_DIM=D,
                BLOCK_M=BLOCK, BLOCK_N=BLOCK, **EXACT_DOTS)
    return (triton.cdiv(N_K, BLOCK), BH), args, (dk, dv)


def _grads_by_autograd(q, k, v, do, causal):
    """dQ, dK, dV of attention(q, k, v, causal) by torch.autograd, in float64."""
    leaves = [t.double()[:, None].requires_grad_() for t in (q, k, v)]
    o = attention(*leaves, causal=causal)
    return tuple(g[:, 0] for g in torch.autograd.grad(o, leaves, do.double()[:, None]))


def _dkdv_autograd(q, k, v, do, causal):
    """dK, dV of attention(q, k, v, causal) by torch.autograd, in float64."""
    return _grads_by_autograd(q, k, v, do, causal)[1:]


def _dkdv_cases():
    shapes = ((1, 16, 16, 16, False), (2, 37, 50, 16, False), (1, 20, 45, 32, True),
              (1, 50, 23, 16, True))
    cases = []
    for n, (bh, n_q, n_k, d, causal) in enumerate(shapes):
        q, k, v, do = _heads((bh, n_q, d), (bh, n_k, d), (bh, n_k, d), (bh, n_q, d), 100 + n)
        cases.append((q * 1.5, k, v, do, causal))
    return cases


DKDV_HINTS = (
    "the forward saved one number per row, lse₂ = lse·log₂e, and section 3 shows how P comes "
    "back from it: one exp2 per score, no max and no row sum. qk is the raw q·kᵀ: which scale "
    "turns it into S·log₂e?",
    "write each product with its shapes: dV and dK are (BLOCK_N, HEAD_DIM) like K and V; dP "
    "and dS are (BLOCK_M, BLOCK_N) like P. tl.trans turns a tile around; tl.dot wants "
    "(M, K) @ (K, N).",
    "delta is one number per query row: a column, [:, None], against the (BLOCK_M, BLOCK_N) "
    "tile dP. sm_scale enters dK once (S = sm_scale·QKᵀ), and not dV.",
)


def check_dkdv(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` dK/dV kernel; against autograd through attention() in
    float64: N_q ≠ N_k, ragged blocks, causal rows that see no key, dK and dV poisoned."""
    return check_kernel("dkdv_kernel", kernel, prepare_dkdv, _dkdv_autograd, _dkdv_cases(),
                        hints=DKDV_HINTS, **TOL, show=show,
                        describe=_describe_heads, nudges={"dV:": DKDV_HINTS[1]},
                        names=("dK", "dV"))


register(Exercise(
    name="dkdv_kernel", lesson="10_backward", kind="triton",
    writes="the dK/dV loop body: the Q and dO tiles, lse2 and delta, P from the saved lse, "
           "the causal mask, then dV, dP, dS, dK", lines=11,
    check=check_dkdv, solution=_dkdv_solution, stub=dkdv_kernel, extra=(prepare_dkdv,),
    mistakes=(
        Mistake("P from exp with the base-2 lse", kernel_variant(
            _dkdv_solution, ("p = tl.math.exp2(", "p = tl.exp(")), "values differ"),
        Mistake("dV = P dO (a swapped transpose)", kernel_variant(
            _dkdv_solution, ("tl.dot(tl.trans(p), do)", "tl.dot(p, do)")), "dV:"),
        Mistake("dK = dS Q (a swapped transpose)", kernel_variant(
            _dkdv_solution, ("tl.dot(tl.trans(ds), q)", "tl.dot(ds, q)")), "dK:"),
        Mistake("dS without delta", kernel_variant(
            _dkdv_solution, ("p * (dp - delta[:, None])", "p * dp")), "dK:"),
        Mistake("dK without sm_scale", kernel_variant(
            _dkdv_solution, ("tl.dot(tl.trans(ds), q) * sm_scale", "tl.dot(tl.trans(ds), q)")),
            "dK:"),
        Mistake("the Q load without its mask", kernel_variant(
            _dkdv_solution, ("q = tl.load(Q + rows, mask=offs_m[:, None] < N_Q, other=0.0)",
                             "q = tl.load(Q + rows)")), "tl.load out of bounds"),
        Mistake("the causal mask from the top-left corner (j <= i)", kernel_variant(
            _dkdv_solution, ("offs_n[None, :] <= offs_m[:, None] + N_K - N_Q",
                             "offs_n[None, :] <= offs_m[:, None]")), "values differ"),
    ),
    hints=DKDV_HINTS))


# =============================================================================================
# 4b. one pass, five matmuls: dQ added by every key block's program (atomic adds)
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def one_pass_kernel(Q, K, V, DO, LSE2, Delta, DQ, DK, DV, sm_scale, N_Q, N_K,
                    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # which BLOCK_N keys
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = pid_bh * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    Q += pid_bh * N_Q * HEAD_DIM
    DO += pid_bh * N_Q * HEAD_DIM
    DQ += pid_bh * N_Q * HEAD_DIM  # fp32 zeros: every key block's program adds its share
    LSE2 += pid_bh * N_Q
    Delta += pid_bh * N_Q
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = ...  # TODO: your exercise 4 lines: the tiles of Q and dO, lse2 and delta
        do = ...  # TODO
        lse2 = ...  # TODO
        delta = ...  # TODO
        p = ...  # TODO: as in exercise 4: P of this block from lse2
        if CAUSAL:
            p = ...  # TODO: as in exercise 4
        dv = ...  # TODO: as in exercise 4
        ds = ...  # TODO: as in exercise 4 (dP first, then P ∘ (dP − delta))
        dk = ...  # TODO: as in exercise 4
        dq = ...  # TODO: this key block's share of dQ for rows offs_m, (BLOCK_M, HEAD_DIM)
        ...  # TODO: add it into DQ's rows offs_m: other programs add theirs to the same rows
    tl.store(DK + kv_ptrs, dk, mask=offs_n[:, None] < N_K)
    tl.store(DV + kv_ptrs, dv, mask=offs_n[:, None] < N_K)


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _one_pass_solution(Q, K, V, DO, LSE2, Delta, DQ, DK, DV, sm_scale, N_Q, N_K,
                       CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # which BLOCK_N keys
    pid_bh = tl.program_id(1)  # which (batch, head)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = pid_bh * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
    Q += pid_bh * N_Q * HEAD_DIM
    DO += pid_bh * N_Q * HEAD_DIM
    DQ += pid_bh * N_Q * HEAD_DIM  # fp32 zeros: every key block's program adds its share
    LSE2 += pid_bh * N_Q
    Delta += pid_bh * N_Q
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + rows, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM)
        do = tl.load(DO + rows, mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM)
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < N_Q, other=float("inf"))  # (BLOCK_M,)
        delta = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + N_K - N_Q, p, 0.0)
        dv = dv + tl.dot(tl.trans(p), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dk = dk + tl.dot(tl.trans(ds), q) * sm_scale
        dq = tl.dot(ds, k) * sm_scale
        tl.atomic_add(DQ + rows, dq, mask=offs_m[:, None] < N_Q)
    tl.store(DK + kv_ptrs, dk, mask=offs_n[:, None] < N_K)
    tl.store(DV + kv_ptrs, dv, mask=offs_n[:, None] < N_K)


def prepare_one_pass(q, k, v, do, causal):
    """The dK/dV launch (``prepare_dkdv``) plus DQ: fp32 zeros, which the programs add into."""
    grid, args, (dk, dv) = prepare_dkdv(q, k, v, do, causal)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return grid, {**args, "DQ": dq}, (dq, dk, dv)


ONE_PASS_HINTS = (
    "section 1's last formula: dQ = τ dS K. This program holds one block of K and the dS of "
    "rows offs_m against it: its product is this key block's share of those rows' dQ.",
    "the shapes: dS is (BLOCK_M, BLOCK_N), K is (BLOCK_N, HEAD_DIM), dQ's rows are "
    "(BLOCK_M, HEAD_DIM). No transpose this time.",
    "a plain store would overwrite what the other key blocks' programs wrote to the same rows. "
    "tl.atomic_add(pointers, values, mask=...) adds instead; its mask is the one of the Q load.",
)


def check_one_pass(kernel, show: bool = True) -> Result:
    """``kernel``: your one-pass ``@triton.jit`` kernel; dQ, dK, dV against autograd through
    attention() in float64 (the dK/dV cases: N_q ≠ N_k, ragged blocks, causal rows that see no
    key)."""
    return check_kernel("one_pass_kernel", kernel, prepare_one_pass, _grads_by_autograd,
                        _dkdv_cases(), hints=ONE_PASS_HINTS, **TOL, show=show,
                        describe=_describe_heads,
                        nudges={"dQ:": ONE_PASS_HINTS[0], "tl.atomic_add": ONE_PASS_HINTS[2]},
                        names=("dQ", "dK", "dV"))


register(Exercise(
    name="one_pass_kernel", lesson="10_backward", kind="triton",
    writes="the dK/dV loop body of exercise 4 again, plus dQ: this key block's share, τ dS K, "
           "added with atomic adds",
    lines=12, check=check_one_pass, solution=_one_pass_solution, stub=one_pass_kernel,
    extra=(prepare_one_pass,),
    mistakes=(
        Mistake("a store instead of an atomic add: the last key block wins", kernel_variant(
            _one_pass_solution, ("tl.atomic_add(DQ + rows, dq, mask=offs_m[:, None] < N_Q)",
                                 "tl.store(DQ + rows, dq, mask=offs_m[:, None] < N_Q)")),
            "dQ:"),
        Mistake("dQ without sm_scale", kernel_variant(
            _one_pass_solution, ("dq = tl.dot(ds, k) * sm_scale", "dq = tl.dot(ds, k)")),
            "dQ:"),
        Mistake("dQ from dSᵀ (a transpose too many)", kernel_variant(
            _one_pass_solution, ("dq = tl.dot(ds, k) * sm_scale",
                                 "dq = tl.dot(tl.trans(ds), k) * sm_scale")), "dQ:"),
        Mistake("no mask on the atomic add: rows past N_q", kernel_variant(
            _one_pass_solution, ("tl.atomic_add(DQ + rows, dq, mask=offs_m[:, None] < N_Q)",
                                 "tl.atomic_add(DQ + rows, dq)")), "tl.atomic_add"),
    ),
    hints=ONE_PASS_HINTS))


# =============================================================================================
# 1. the five formulas
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def attention_backward(q, k, v, do, sm_scale):
    # TODO: S, P, then dV, dP, delta, dS, dQ, dK
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
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


def _backward_no_keepdim(q, k, v, do, sm_scale):
    p = torch.softmax(sm_scale * q @ k.T, dim=-1)
    dp = do @ v.T
    ds = p * (dp - (p * dp).sum(-1))
    return sm_scale * ds @ k, sm_scale * ds.T @ q, p.T @ do


def _backward_no_scale(q, k, v, do, sm_scale):
    p = torch.softmax(sm_scale * q @ k.T, dim=-1)
    dp = do @ v.T
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return ds @ k, ds.T @ q, p.T @ do


def _backward_no_delta(q, k, v, do, sm_scale):
    p = torch.softmax(sm_scale * q @ k.T, dim=-1)
    ds = p * (do @ v.T)
    return sm_scale * ds @ k, sm_scale * ds.T @ q, p.T @ do


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


BACKWARD_HINTS = (
    "walk the forward backwards: O = PV is a matmul (it gives dV and dP); P = softmax(S) acts "
    "row by row (it gives dS, through delta); S = τ·QKᵀ is a matmul again (dQ and dK).",
    "let the shapes place the transposes: dV has V's shape (N_k, d), dP has P's shape "
    "(N_q, N_k), dK has K's shape.",
    "delta is one number per query row: keep it a column (N_q, 1) so that it meets every key "
    "of its row; τ appears in dQ and in dK.",
)


def check_attention_backward(student, show: bool = True) -> Result:
    """``student(q, k, v, do, sm_scale) -> (dq, dk, dv)`` against torch.autograd (fp64)."""
    return check("attention_backward", student, _autograd_backward, _backward_cases(),
                 hints=BACKWARD_HINTS, rtol=1e-9, atol=1e-12, show=show,
                 describe=lambda c: f"N_q = {c[0].shape[0]}, N_k = {c[1].shape[0]}, "
                                    f"d = {c[0].shape[1]}, sm_scale = {c[4]:.3g}",
                 names=("dQ", "dK", "dV"))


register(Exercise(
    name="attention_backward", lesson="10_backward", kind="python",
    writes="dQ, dK, dV of one head from the five formulas", lines=7,
    check=check_attention_backward, solution=attention_backward_solution,
    stub=attention_backward,
    mistakes=(Mistake("delta without keepdim", _backward_no_keepdim, "case"),
              Mistake("no sm_scale in dQ and dK", _backward_no_scale, "dQ:"),
              Mistake("dS without delta", _backward_no_delta, "dQ:")),
    hints=BACKWARD_HINTS))


# =============================================================================================
# 2. delta without P
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def delta(o, do):
    # TODO
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def delta_solution(o, do):
    """delta_i = Σ_d dO_id · O_id, shape (..., N_q)."""
    return (do * o).sum(-1)


def _delta_keepdim(o, do):
    return (do * o).sum(-1, keepdim=True)


def _delta_wrong_axis(o, do):
    return (do * o).sum(-2)


def _delta_matmul(o, do):
    return do @ o.transpose(-1, -2)


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


DELTA_HINTS = (
    "start from the definition, delta_i = Σ_j P_ij dP_ij with dP = dO Vᵀ, and swap the two "
    "sums: what is Σ_j P_ij V_jc?",
    "one number per query row, shape (..., N_q): a sum over the last axis, with no kept "
    "dimension.",
)


def check_delta(student, show: bool = True) -> Result:
    """``student(o, do) -> delta`` equals rowsum(P ∘ dP), computed here with P."""
    return check("delta", lambda o, do, p, v: student(o, do), _delta_from_p, _delta_cases(),
                 hints=DELTA_HINTS, rtol=1e-9, atol=1e-12, show=show,
                 describe=lambda c: f"o and do {tuple(c[0].shape)}",
                 nudges={"shape": DELTA_HINTS[1]})


register(Exercise(
    name="delta", lesson="10_backward", kind="python",
    writes="delta = rowsum(dO ∘ O), without P", lines=1,
    check=check_delta, solution=delta_solution, stub=delta,
    mistakes=(Mistake("keepdim=True", _delta_keepdim, "shape"),
              Mistake("the sum over the rows", _delta_wrong_axis, "shape"),
              Mistake("a matrix product dO Oᵀ", _delta_matmul, "shape")),
    hints=DELTA_HINTS))


# =============================================================================================
# 5. Algorithm 3's HBM accesses
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def standard_backward_elements(N, d):
    # TODO: return a number
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def standard_backward_elements_solution(N, d):
    """Elements Algorithm 3 moves for one head (N_q = N_k = N)."""
    square, thin = N * N, N * d  # P, dP, dS are N × N; Q, K, V, dO and the gradients N × d
    step1 = square + thin + thin  # read P, dO; write dV
    step2 = thin + thin + square  # read dO, V; write dP
    step3 = square + square + square  # read P, dP; write dS
    step4 = square + thin + thin  # read dS, K; write dQ
    step5 = square + thin + thin  # read dS, Q; write dK
    return step1 + step2 + step3 + step4 + step5


def _elements_reads_only(N, d):
    return 5 * N * N + 5 * N * d


def _elements_kept_on_chip(N, d):
    return 5 * N * N + 8 * N * d


def _elements_bytes(N, d):
    return 2 * standard_backward_elements_solution(N, d)


COUNT_HINTS = (
    "Algorithm 3 has five steps, and each reads its inputs from HBM and writes its result "
    "back: nothing stays on chip from one step to the next. Count elements, not bytes.",
    "P, dP and dS are N × N; Q, K, V, dO, dQ, dK and dV are N × d.",
    "step 1 reads P and dO and writes dV: N² + 2·N·d elements. The other four go the same "
    "way.",
)


def check_standard_backward_elements(student, show: bool = True) -> Result:
    from course_lib.iomodel.backward import standard_backward_io

    return check("standard_backward_elements", student,
                 lambda N, d: standard_backward_io(N, N, d)["elements"],
                 [(4, 2), (1024, 64), (4096, 128)], hints=COUNT_HINTS, rtol=0, atol=0.5,
                 show=show, describe=lambda c: f"N = {c[0]}, d = {c[1]}")


register(Exercise(
    name="standard_backward_elements", lesson="10_backward", kind="python",
    writes="Algorithm 3's HBM accesses, in elements", lines=1,
    check=check_standard_backward_elements, solution=standard_backward_elements_solution,
    stub=standard_backward_elements,
    mistakes=(Mistake("reads only", _elements_reads_only, "values differ"),
              Mistake("dP and dS kept on chip", _elements_kept_on_chip, "values differ"),
              Mistake("bytes (fp16), not elements", _elements_bytes, "values differ")),
    hints=COUNT_HINTS))
