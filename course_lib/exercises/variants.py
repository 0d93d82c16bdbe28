"""Exercises of notebooks/15_attention_variants.ipynb: the variants of open models' attention.

1. ``window_key_range`` (Python): the keys a block of query rows sees under a window,
   bottom-right aligned, as (lo, full_lo, full_hi, hi): the rule that decides which key blocks
   a kernel skips, runs unmasked or runs masked (against ``masks.block_key_range``);
2. ``softcap_ds`` (PyTorch): the softcap's term in dS, the chain rule through c·tanh(s/c)
   (against torch.autograd);
3. ``sink_grad`` (PyTorch): the gradient of a learned per-head sink logit from O, dO and the
   saved lse (against torch.autograd through ``reference.attention_variants``);
4. ``window_kernel`` (Triton): a minimal sliding-window forward; the student writes the key
   range the loop visits and the in-band mask (against ``reference.attention_variants`` in
   float64, awkward shapes, rows that see no key, O poisoned, every load checked);
5. a think-question with a number: the window's ceiling with 64 × 64 tiles.

Wrong answers are the mistakes students make with these rules: top-left instead of
bottom-right, the full range taken from the wrong rows, an exclusive bound off by one, −1 read
as a width, tanh applied twice, a sign, a sum left out, a bound not clamped (an out-of-bounds
load the sandbox reports), keys past N_K left in the band.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib import masks
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
from course_lib.exercises.flash_v2 import EXACT_DOTS, TOL, kernel_variant
from course_lib.reference import attention_variants

BLOCK = 16  # tl.dot needs every dimension >= 16
LESSON = "15_attention_variants"


# =============================================================================================
# 1. the window's key range for a block of query rows
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def window_key_range(r0, r1, n_q, n_k, window):
    # TODO: return (lo, full_lo, full_hi, hi) for the query rows r0 .. r1 - 1
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def window_key_range_solution(r0, r1, n_q, n_k, window):
    """Keys the query rows [r0, r1) see under ``window`` = (left, right), −1 unbounded,
    bottom-right aligned: some row sees each key of [lo, hi), every row each key of
    [full_lo, full_hi). Rows that see no key at all: (0, 0, 0, 0)."""
    left, right = window
    first, last = r0 + n_k - n_q, r1 - 1 + n_k - n_q  # key positions p of the first, last row
    lo = 0 if left < 0 else max(0, first - left)  # the first row reaches furthest left
    hi = n_k if right < 0 else min(n_k, last + right + 1)  # the last row furthest right
    full_lo = 0 if left < 0 else max(0, last - left)  # keys every row sees: from the last
    full_hi = n_k if right < 0 else min(n_k, first + right + 1)  # row's first to the first's last
    if hi <= lo:
        return 0, 0, 0, 0
    return lo, min(max(full_lo, lo), hi), max(min(full_hi, hi), lo), hi


def _range_top_left(r0, r1, n_q, n_k, window):
    left, right = window
    first, last = r0, r1 - 1  # row i at key position i: top-left
    lo = 0 if left < 0 else max(0, first - left)
    hi = n_k if right < 0 else min(n_k, last + right + 1)
    full_lo = 0 if left < 0 else max(0, last - left)
    full_hi = n_k if right < 0 else min(n_k, first + right + 1)
    return (0, 0, 0, 0) if hi <= lo else (lo, full_lo, full_hi, hi)


def _range_full_from_wrong_rows(r0, r1, n_q, n_k, window):
    lo, _, _, hi = window_key_range_solution(r0, r1, n_q, n_k, window)
    return lo, lo, hi, hi  # "every row sees every key some row sees"


def _range_exclusive_off_by_one(r0, r1, n_q, n_k, window):
    left, right = window
    first, last = r0 + n_k - n_q, r1 - 1 + n_k - n_q
    lo = 0 if left < 0 else max(0, first - left)
    hi = n_k if right < 0 else min(n_k, last + right)
    full_lo = 0 if left < 0 else max(0, last - left)
    full_hi = n_k if right < 0 else min(n_k, first + right)
    return (0, 0, 0, 0) if hi <= lo else (lo, full_lo, full_hi, hi)


def _range_minus_one_as_width(r0, r1, n_q, n_k, window):
    left, right = window
    first, last = r0 + n_k - n_q, r1 - 1 + n_k - n_q
    lo, hi = max(0, first - left), min(n_k, last + right + 1)
    full_lo, full_hi = max(0, last - left), min(n_k, first + right + 1)
    return (0, 0, 0, 0) if hi <= lo else (lo, full_lo, full_hi, hi)


def _range_unclamped(r0, r1, n_q, n_k, window):
    left, right = window
    first, last = r0 + n_k - n_q, r1 - 1 + n_k - n_q
    lo = 0 if left < 0 else first - left
    hi = n_k if right < 0 else last + right + 1
    full_lo = 0 if left < 0 else last - left
    full_hi = n_k if right < 0 else first + right + 1
    return (0, 0, 0, 0) if hi <= lo else (lo, full_lo, full_hi, hi)


def _canonical(t):
    """(lo, full_lo, full_hi, hi) as four ints, with every empty range written one way: rows
    that see no key (0, 0, 0, 0); no key every row sees (lo, lo, lo, hi)."""
    if not isinstance(t, (tuple, list)) or len(t) != 4:
        raise TypeError(f"return a tuple of four ints (lo, full_lo, full_hi, hi), got {t!r}")
    lo, full_lo, full_hi, hi = (int(x) for x in t)
    if hi <= lo:
        return (0, 0, 0, 0)
    if full_hi <= full_lo:
        return (lo, lo, lo, hi)
    return (lo, full_lo, full_hi, hi)


RANGE_CASES = (  # (r0, r1, n_q, n_k, window): r1 = min(r0 + BLOCK_M, n_q)
    (0, 16, 64, 64, (-1, 0)), (48, 64, 64, 64, (-1, 0)), (32, 64, 100, 100, (16, 0)),
    (64, 96, 100, 100, (40, 0)), (96, 100, 100, 100, (8, 8)), (0, 30, 30, 100, (-1, 0)),
    (0, 64, 130, 60, (-1, 0)), (64, 128, 130, 60, (-1, 0)), (128, 130, 130, 60, (5, 0)),
    (0, 16, 50, 50, (3, 2)), (16, 32, 40, 70, (0, -1)), (32, 48, 48, 48, (-1, -1)),
    (0, 1, 1, 77, (10, 0)), (256, 384, 1000, 1000, (128, 0)), (0, 16, 20, 37, (-1, 5)),
)

RANGE_HINTS = (
    "bottom-right: query row i sits at key position p = i + N_k − N_q, and sees the keys "
    "p − left … p + right (−1: no limit on that side). Which row of the block reaches "
    "furthest left, and which furthest right?",
    "some row sees [lo, hi): lo from the first row, hi from the last, and hi is one past a key "
    "the row sees. Every row sees [full_lo, full_hi): the other way round, the last row's "
    "first key to one past the first row's last key.",
    "clamp every bound into [0, N_k], and a side of −1 is no limit at all, not a width. When "
    "hi ≤ lo no row sees a key: return (0, 0, 0, 0).",
)

RANGE_NUDGES = {  # the output of the tuple that differs first
    " lo:": "lo is the first key that some row of the block sees. Which row reaches "
           "furthest left, and where does that row sit among the keys?",
    " full_lo:": "full_lo: from there on every row of the block sees the keys (up to "
                "full_hi). Which row's window starts last?",
    " full_hi:": "full_hi is one past the last key that every row of the block sees. "
                "Which row's window ends first?",
    " hi:": "hi is one past the last key that some row of the block sees. Which row "
           "reaches furthest right, and where does that row sit among the keys?",
}


def check_window_key_range(student, show: bool = True) -> Result:
    """Against ``masks.block_key_range`` on N_q ≠ N_k both ways, ragged last blocks, rows that
    see no key, one- and two-sided windows; every empty range counts as one."""
    def run(*case):
        got = student(*case)
        return None if got is None else _canonical(got)

    return check("window_key_range", run, lambda *c: _canonical(masks.block_key_range(*c)),
                 RANGE_CASES, hints=RANGE_HINTS, rtol=0, atol=0, show=show,
                 describe=lambda c: "rows {}..{}, N_q={}, N_k={}, window={}".format(
                     c[0], c[1] - 1, *c[2:]),
                 nudges={"TypeError": "return a tuple of four ints: (lo, full_lo, full_hi, hi).",
                         **RANGE_NUDGES}, names=("lo", "full_lo", "full_hi", "hi"))


register(Exercise(
    name="window_key_range", lesson=LESSON, kind="python",
    writes="the keys a block of query rows sees under a window: (lo, full_lo, full_hi, hi)",
    lines=7, check=check_window_key_range, solution=window_key_range_solution,
    stub=window_key_range,
    mistakes=(Mistake("top-left (no N_k − N_q)", _range_top_left, "values differ"),
              Mistake("the full range taken from the wrong rows", _range_full_from_wrong_rows,
                      "values differ"),
              Mistake("hi = p + right (one short)", _range_exclusive_off_by_one,
                      "values differ"),
              Mistake("−1 read as a width", _range_minus_one_as_width, "values differ"),
              Mistake("bounds not clamped to [0, N_k]", _range_unclamped, "values differ")),
    hints=RANGE_HINTS))


# =============================================================================================
# 2. the softcap's term in dS
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def softcap_ds(ds, s, softcap):
    # TODO: dS before the cap, from ds (the gradient after it) and the capped scores s
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def softcap_ds_solution(ds, s, softcap):
    """The gradient with respect to the raw score r, given ds = ∂L/∂s for the capped score
    s = c·tanh(r / c) (which the kernel has): ∂s/∂r = 1 − tanh²(r / c) = 1 − (s / c)²."""
    return ds * (1 - (s / softcap) ** 2)


def _softcap_tanh_twice(ds, s, softcap):
    return ds * (1 - torch.tanh(s / softcap) ** 2)


def _softcap_no_square(ds, s, softcap):
    return ds * (1 - s / softcap)


def _softcap_over_c(ds, s, softcap):
    return ds * (1 - (s / softcap) ** 2) / softcap


def _softcap_no_c(ds, s, softcap):
    return ds * (1 - s ** 2)


def _softcap_cases():
    gen = torch.Generator().manual_seed(151)
    cases = []
    for shape, c, spread in (((4, 7), 50.0, 60.0), ((2, 3, 5, 9), 30.0, 40.0), ((16,), 5.0, 8.0),
                             ((3, 11), 1.0, 2.0)):
        raw = torch.randn(*shape, generator=gen, dtype=torch.float64) * spread
        ds = torch.randn(*shape, generator=gen, dtype=torch.float64)
        cases.append((ds, c * torch.tanh(raw / c), c, raw))
    return cases


def _softcap_autograd(ds, s, softcap, raw):
    r = raw.clone().requires_grad_()
    (g,) = torch.autograd.grad(softcap * torch.tanh(r / softcap), r, ds)
    return g


SOFTCAP_HINTS = (
    "the chain rule through s = c·tanh(r / c): ∂s/∂r = c · tanh'(r / c) · (1 / c). What is "
    "the derivative of tanh, written with tanh itself?",
    "s is already capped: tanh(r / c) = s / c. No tanh is needed at all, and c cancels once.",
)


def check_softcap_ds(student, show: bool = True) -> Result:
    """Against torch.autograd through c·tanh(r / c) in float64, caps from 1 to 50 and raw
    scores that saturate the cap."""
    return check("softcap_ds", lambda ds, s, c, raw: student(ds, s, c), _softcap_autograd,
                 _softcap_cases(), hints=SOFTCAP_HINTS, rtol=1e-9, atol=1e-12, show=show,
                 describe=lambda c: f"ds and s of shape {tuple(c[0].shape)}, softcap = {c[2]:g}")


register(Exercise(
    name="softcap_ds", lesson=LESSON, kind="python",
    writes="the softcap's term in dS: the chain rule through c·tanh(s / c)", lines=1,
    check=check_softcap_ds, solution=softcap_ds_solution, stub=softcap_ds,
    mistakes=(Mistake("tanh applied to the capped score again", _softcap_tanh_twice,
                      "values differ"),
              Mistake("1 − s/c, no square", _softcap_no_square, "values differ"),
              Mistake("an extra 1/c", _softcap_over_c, "values differ"),
              Mistake("1 − s², c forgotten", _softcap_no_c, "values differ")),
    hints=SOFTCAP_HINTS))


# =============================================================================================
# 3. the sink's gradient
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def sink_grad(o, do, lse, sinks):
    # TODO: d sinks, one number per head: shape (H,)
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def sink_grad_solution(o, do, lse, sinks):
    """∂L/∂sink_h = −Σ_{b,i} P_sink,i · delta_i, with P_sink,i = exp(sink_h − lse_i) (the
    saved lse includes the sink) and delta_i = dO_i · O_i. o, do (B, H, N_q, D), lse
    (B, H, N_q), sinks (H,)."""
    p_sink = torch.exp(sinks[None, :, None] - lse)  # (B, H, N_q): the sink's share of each row
    delta = (do * o).sum(-1)  # (B, H, N_q)
    return -(p_sink * delta).sum(dim=(0, 2))  # (H,)


def _sink_plus(o, do, lse, sinks):
    return -sink_grad_solution(o, do, lse, sinks)


def _sink_per_batch(o, do, lse, sinks):
    return -(torch.exp(sinks[None, :, None] - lse) * (do * o).sum(-1)).sum(dim=2)


def _sink_unnormalised(o, do, lse, sinks):
    return -(torch.exp(sinks)[None, :, None] * (do * o).sum(-1)).sum(dim=(0, 2))


def _sink_mean(o, do, lse, sinks):
    return -(torch.exp(sinks[None, :, None] - lse) * (do * o).sum(-1)).mean(dim=(0, 2))


def _sink_cases():
    gen = torch.Generator().manual_seed(152)
    cases = []
    for B, H, H_kv, n_q, n_k, d, variants in (
            (2, 3, 3, 5, 7, 4, {}),
            (1, 2, 1, 9, 4, 8, {"causal": True}),  # GQA; rows 0-4 see no key: lse = the sink
            (2, 4, 2, 12, 12, 8, {"window_size": (3, 0), "softcap": 5.0})):
        q = torch.randn(B, H, n_q, d, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(B, H_kv, n_k, d, generator=gen, dtype=torch.float64)
                for _ in range(2))
        do = torch.randn(B, H, n_q, d, generator=gen, dtype=torch.float64)
        sinks = torch.randn(H, generator=gen, dtype=torch.float64) * 2
        o, lse = attention_variants(q, k, v, sinks=sinks, return_lse=True, **variants)
        cases.append((o, do, lse, sinks, q, k, v, variants))
    return cases


def _sink_autograd(o, do, lse, sinks, q, k, v, variants):
    leaf = sinks.clone().requires_grad_()
    out = attention_variants(q, k, v, sinks=leaf, **variants)
    (g,) = torch.autograd.grad(out, leaf, do)
    return g


SINK_HINTS = (
    "the sink is one more logit in each row's softmax, with no value. Its share of row i is "
    "P_sink,i = e^sink / (e^sink + Σ_j e^s_ij): the saved lse already holds that denominator.",
    "differentiate O_i = Σ_j P_ij V_j by the sink: every P_ij shrinks by P_ij·P_sink,i, so "
    "∂L/∂sink = −Σ_i P_sink,i Σ_j P_ij dP_ij, and lesson 10 showed Σ_j P_ij dP_ij = dO_i·O_i.",
    "one sink per head: sum over the batch and over the rows, and keep the heads (shape (H,)).",
)


def check_sink_grad(student, show: bool = True) -> Result:
    """Against torch.autograd through ``reference.attention_variants`` in float64: a window
    and a softcap, GQA, and causal rows that see no key (whose lse is the sink)."""
    return check("sink_grad", lambda o, do, lse, sinks, *rest: student(o, do, lse, sinks),
                 _sink_autograd, _sink_cases(), hints=SINK_HINTS, rtol=1e-9, atol=1e-12,
                 show=show, nudges={"shape": SINK_HINTS[2]},
                 describe=lambda c: f"o {tuple(c[0].shape)}, sinks {tuple(c[3].shape)}, "
                 f"{c[7] or 'full attention'}")


register(Exercise(
    name="sink_grad", lesson=LESSON, kind="python",
    writes="the gradient of a learned sink logit from O, dO and the saved lse", lines=3,
    check=check_sink_grad, solution=sink_grad_solution, stub=sink_grad,
    mistakes=(Mistake("the sign", _sink_plus, "values differ"),
              Mistake("not summed over the batch", _sink_per_batch, "shape"),
              Mistake("e^sink, not divided by the row's sum", _sink_unnormalised,
                      "values differ"),
              Mistake("a mean over the rows", _sink_mean, "values differ")),
    hints=SINK_HINTS))


# =============================================================================================
# 4. a minimal sliding-window kernel
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def window_kernel(Q, K, V, O, sm_scale, N_Q, N_K, LEFT, RIGHT, HEAD_DIM: tl.constexpr,
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
    offset = N_K - N_Q  # bottom-right: query i sits at key position p = i + offset
    lo = ...  # TODO: the first key some row of this block sees (never below 0)
    hi = ...  # TODO: one past the last key some row of this block sees (never past N_K)
    for start_n in range(lo, hi, BLOCK_N):  # key blocks outside [lo, hi) are skipped
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = ...  # TODO: Kᵀ of this key block, (HEAD_DIM, BLOCK_N); keys past N_K as 0
        v = ...  # TODO: V of this key block, (BLOCK_N, HEAD_DIM); keys past N_K as 0
        qk = ...  # TODO: the raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        visible = ...  # TODO: (BLOCK_M, BLOCK_N): key offs_n in the band of row offs_m, < N_K
        s = ...  # TODO: the scaled scores (base 2), −inf where not visible
        m_new = ...  # TODO: the running max after this block
        m_ref = ...  # TODO: the max to subtract: 0 in rows that saw no key yet
        alpha = ...  # TODO: the factor that moves l_i and acc to the new max
        p = ...  # TODO: this block's exponentials
        l_i = ...  # TODO
        acc = ...  # TODO
        m_i = ...  # TODO
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # O = 0 in a row that sees no key
    tl.store(o_ptrs, o, mask=offs_m[:, None] < N_Q)


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _window_solution(Q, K, V, O, sm_scale, N_Q, N_K, LEFT, RIGHT, HEAD_DIM: tl.constexpr,
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
    offset = N_K - N_Q  # bottom-right: query i sits at key position p = i + offset
    lo = (tl.maximum(start_m + offset - LEFT, 0) // BLOCK_N) * BLOCK_N  # aligned, as the library
    hi = tl.minimum(tl.minimum(start_m + BLOCK_M, N_Q) - 1 + offset + RIGHT + 1, N_K)
    for start_n in range(lo, hi, BLOCK_N):  # key blocks outside [lo, hi) are skipped
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=offs_n[None, :] < N_K, other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)  # (BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, kT)  # raw scores q·kᵀ, (BLOCK_M, BLOCK_N)
        pos = offs_m[:, None] + offset  # (BLOCK_M, 1): each row's key position p
        visible = ((offs_n[None, :] >= pos - LEFT) & (offs_n[None, :] <= pos + RIGHT)
                   & (offs_n[None, :] < N_K))
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # O = 0 in a row that sees no key
    tl.store(o_ptrs, o, mask=offs_m[:, None] < N_Q)


def _unbounded(left, right, n_q, n_k):
    """The kernel's LEFT and RIGHT: −1 (no limit) becomes a window wider than the sequence."""
    wide = max(n_q, n_k)
    return (wide if left < 0 else left), (wide if right < 0 else right)


def prepare_window(q, k, v, window):
    """One launch: a program per (BLOCK query rows, batch·head); q (B·H, N_q, D), k, v (B·H,
    N_k, D) contiguous; ``window`` (left, right), −1 passed as a side wider than the
    sequence; O poisoned."""
    BH, N_Q, D = q.shape
    N_K = k.shape[1]
    left, right = _unbounded(*window, N_Q, N_K)
    o = poisoned(BH, N_Q, D, like=q)
    grid = (triton.cdiv(N_Q, BLOCK), BH)
    args = dict(Q=q, K=k, V=v, O=o, sm_scale=D ** -0.5, N_Q=N_Q, N_K=N_K, LEFT=left,
                RIGHT=right, HEAD_DIM=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, **EXACT_DOTS)
    return grid, args, o


def _window_spec(q, k, v, window):
    """The window's attention per (batch·head), in float64 (``reference.attention_variants``)."""
    return attention_variants(q.double()[:, None], k.double()[:, None], v.double()[:, None],
                              window_size=window)[:, 0]


def _window_cases():
    gen = torch.Generator().manual_seed(153)
    shapes = ((1, 16, 16, 16, (4, 0)), (2, 37, 50, 16, (7, 3)), (1, 50, 23, 16, (5, 0)),
              (1, 45, 45, 32, (-1, 2)), (1, 33, 70, 16, (0, -1)),
              (1, 32, 32, 16, (0, 1)),  # row 15 sees key 16: the first key of the next block
              (1, 80, 80, 16, (3, 0)))  # a narrow band: most key blocks are skipped
    return [tuple(torch.randn(bh, n, d, generator=gen) * s
                  for n, s in ((n_q, 1.5), (n_k, 1.0), (n_k, 1.0))) + (window,)
            for bh, n_q, n_k, d, window in shapes]


def _blocks_in_band(start_m, n_q, n_k, window) -> tuple[int, int, int]:
    """The keys the rows start_m … start_m + BLOCK − 1 see, first and last, and the key blocks
    of BLOCK keys from the one holding the first to the one holding the last (0 when the band
    holds no key)."""
    left, right = _unbounded(*window, n_q, n_k)
    offset = n_k - n_q
    first = max(start_m + offset - left, 0)
    last = min(min(start_m + BLOCK, n_q) - 1 + offset + right, n_k - 1)
    blocks = last // BLOCK - first // BLOCK + 1 if last >= first else 0
    return first, last, blocks


def _window_visits(case, loads) -> str | None:
    """A program that loaded more key blocks of K than its rows' band spans: the loop did
    not skip what the window leaves out (the outputs can still be right)."""
    q, k, window = case[0], case[1], case[3]
    n_q, n_k = q.shape[1], k.shape[1]
    for (tensor, (pid_m, pid_bh, _)), n in sorted(loads.items()):
        if tensor != "K":
            continue
        first, last, blocks = _blocks_in_band(pid_m * BLOCK, n_q, n_k, window)
        if n > blocks:
            band = f"keys {first} … {last}, in {blocks} blocks" if blocks else "no key"
            return (f"the outputs are right, but program ({pid_m}, {pid_bh}) loaded {n} blocks "
                    f"of K, and the rows of its block see {band}: the loop visits key blocks "
                    f"outside the band, which a window kernel must skip")
    return None


def _describe_window(case):
    q, k, window = case[0], case[1], case[3]
    return (f"B·H = {q.shape[0]}, N_q = {q.shape[1]}, N_k = {k.shape[1]}, D = {q.shape[2]}, "
            f"window (left, right) = {window}")


WINDOW_HINTS = (
    "row i of the block sees keys p − LEFT … p + RIGHT with p = i + offset. The loop must "
    "visit every key some row sees: the block's first row reaches furthest left, its last "
    "real row (mind rows past N_Q) furthest right.",
    "the loop body is lesson 08's causal kernel's with `visible` in place of the causal "
    "mask: the two tiles loaded with a mask past N_K, the scores scaled to base 2 and set to "
    "−inf outside the band, then the online-softmax step (a row that saw no key yet subtracts "
    "0, not −inf).",
    "clamp: lo never below 0 (a load at a negative offset is out of bounds), hi never past "
    "N_K. Rounding lo down to a multiple of BLOCK_N, as the library does, keeps the loads "
    "aligned; either is right here.",
    "visible combines three comparisons with &: the key is not left of p − LEFT, not right of "
    "p + RIGHT (inclusive on both sides), and it exists (< N_K): with a wide RIGHT the last "
    "key block hangs over the end, and its keys past N_K load as 0, not as −∞.",
)

WINDOW_NUDGES = {
    "tl.load out of bounds": "a load reads before the start of K or V: the first key block "
                             "starts at a negative offset. Clamp lo at 0.",
}


def check_window_kernel(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` sliding-window forward; against
    ``reference.attention_variants`` in float64: N_q ≠ N_k both ways, ragged blocks, one- and
    two-sided windows, rows that see no key, a band that ends one key into the next block, O
    poisoned, every load and store checked, and no key block loaded outside a block's band."""
    return check_kernel("window_kernel", kernel, prepare_window, _window_spec, _window_cases(),
                        hints=WINDOW_HINTS, **TOL, show=show, describe=_describe_window,
                        nudges=WINDOW_NUDGES, visits=_window_visits)


register(Exercise(
    name="window_kernel", lesson=LESSON, kind="triton",
    writes="a sliding-window kernel: the key range the loop visits and the whole loop body "
           "(loads, in-band mask, online softmax)", lines=14, check=check_window_kernel,
    solution=_window_solution, stub=window_kernel,
    extra=(prepare_window,),
    mistakes=(
        Mistake("lo not clamped at 0", kernel_variant(
            _window_solution, ("(tl.maximum(start_m + offset - LEFT, 0) // BLOCK_N)",
                               "((start_m + offset - LEFT) // BLOCK_N)")),
            "tl.load out of bounds"),
        Mistake("hi from the block's first row", kernel_variant(
            _window_solution, ("tl.minimum(start_m + BLOCK_M, N_Q) - 1 + offset", "start_m + "
                               "offset")), "values differ"),
        Mistake("top-left: no offset in the band", kernel_variant(
            _window_solution, ("pos = offs_m[:, None] + offset", "pos = offs_m[:, None]")),
            "values differ"),
        Mistake("< for <= at the right edge", kernel_variant(
            _window_solution, ("<= pos + RIGHT", "< pos + RIGHT")), "values differ"),
        Mistake("keys past N_K left in the band", kernel_variant(
            _window_solution, ("\n                   & (offs_n[None, :] < N_K))", ")")),
            "values differ"),
        Mistake("no left edge in the mask (causal only)", kernel_variant(
            _window_solution, ("(offs_n[None, :] >= pos - LEFT) & ", "")), "values differ"),
        Mistake("no guard for rows that saw no key: m_new subtracted when it is −inf",
                kernel_variant(_window_solution, (
                    'm_ref = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_ref = m_new")),
                "NaN"),
        Mistake("no key block skipped: lo = 0, hi = N_K", kernel_variant(
            _window_solution,
            ("(tl.maximum(start_m + offset - LEFT, 0) // BLOCK_N) * BLOCK_N", "0"),
            ("tl.minimum(tl.minimum(start_m + BLOCK_M, N_Q) - 1 + offset + RIGHT + 1, N_K)",
             "N_K")), "outside the band"),
        Mistake("hi one short: the last row's last key left out", kernel_variant(
            _window_solution, ("- 1 + offset + RIGHT + 1, N_K)", "- 1 + offset + RIGHT, N_K)")),
            "values differ"),
    ),
    hints=WINDOW_HINTS))


# =============================================================================================
# 5. a question with a number: the window's ceiling with other tiles
# =============================================================================================
def computed_pairs(n: int, block_m: int, block_n: int, window) -> int:
    """The (query, key) pairs the tiles of one head compute (N_q = N_k = n), query block by
    query block from ``masks.block_key_range``: what ``iomodel.variants.variant_io`` counts
    tile by tile, in T_r steps instead of T_r·T_c (a test holds the two together)."""
    total = 0
    for r0 in range(0, n, block_m):
        r1 = min(r0 + block_m, n)
        lo, _, _, hi = masks.block_key_range(r0, r1, n, n, window)
        if hi > lo:  # whole key blocks from the one holding lo to the one holding hi - 1
            total += (r1 - r0) * (min(-(-hi // block_n) * block_n, n) - lo // block_n * block_n)
    return total


def _ceiling(block_m: int, block_n: int, n: int = 16384, window: int = 1024) -> float:
    return (computed_pairs(n, block_m, block_n, (-1, 0))
            / computed_pairs(n, block_m, block_n, (window, 0)))


_CEILING_64 = _ceiling(64, 64)
_CEILING_128 = _ceiling(128, 64)
_CEILING_16 = _ceiling(16, 16)

register(Question(
    name="q15_tile_ceiling", lesson=LESSON,
    asks="At N = 16k, causal with a window of 1024 against full causal: with 64 × 64 tiles "
         "instead of 128 × 64, how many times fewer (query, key) pairs do the window's tiles "
         "compute?",
    value=_CEILING_64, rtol=0.005,
    answer=(
        f"About {_CEILING_64:.2f}x, against {_CEILING_128:.2f}x with 128 × 64 tiles and an area "
        "8.25x smaller. Count it with iomodel.variants.variant_io(16384, 16384, 128, 64, 64, "
        "window) for window (-1, 0) and (1024, 0), and divide the two computed_pairs.\n\n"
        "Why it moves: full causal computes the area under the diagonal plus about half a "
        "BLOCK_M × BLOCK_M square per block of query rows (its masked diagonal tiles). Under "
        "the window each row sees left + 1 keys, but a block of BLOCK_M rows visits every key "
        "from its first row's first key to its last row's last key: left + BLOCK_M keys a "
        "row, rounded out to whole key blocks. So the window pays about BLOCK_M extra keys a "
        "row where causal pays about BLOCK_M / 2, on a much smaller area. Shorter query "
        "blocks waste less at the edges: with 16 × 16 tiles the ratio is "
        f"{_CEILING_16:.2f}x, and it climbs towards 8.25x as the tiles shrink. A kernel pays "
        "for small tiles with more programs, more K/V re-reads and smaller matrix products "
        "on the tensor cores (lessons 08 and 09).")))
