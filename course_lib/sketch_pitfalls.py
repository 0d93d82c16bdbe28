"""Common pitfalls of a first block-by-block attention forward, measured and fixed.

Introduced in notebooks/06_flash_v1_algorithm.ipynb. Algorithm 1 of the FlashAttention paper
(Dao et al. 2022, https://arxiv.org/abs/2205.14135) is often first written as a short torch loop:
K/V blocks outside, Q blocks inside, running statistics m and l, the O update of Algorithm 1.
``first_try`` is such a loop, the course's own, with five mistakes that circulate in
explanations of it. The loop's structure and its update formulas are right; the five details
are not, and each one changes the numbers:

=========  ==================================================  ===================================
name       the pitfall                                         the fix (as ``course_lib.reference``)
=========  ==================================================  ===================================
scale      S = Q_i K_jᵀ, no 1/√d                                S = sm_scale · Q_i K_jᵀ
mask       ``S.ge(0.5)`` filled with 0: a test on the score's   the causal mask, filled with −inf
           value, not its position; it clips large scores
           to 0 and hides no key at all
tail       T_r = N_q // B_r, T_c = N_k // B_c: a last partial   ⌈N/B⌉ blocks
           block is never visited
dropout    ``nn.Dropout`` on P̃_ij·V_j (B_r × d): drops output    the keep-mask on P̃_ij (B_r × B_c),
           features, not attention probabilities               after l̃ is taken, before ·V_j
init       m starts at −1e10, l̃ gets +1e-10, masks use the       m = −∞, l = 0, exp(−∞ − (−∞)) := 0:
           finite sentinel: a row that sees no key averages    such a row's output is 0
           V (or gives NaN with a −∞ mask)
=========  ==================================================  ===================================

``first_try`` is the loop with all five, as a reader would write it. ``sketch_forward(...,
fixes=...)`` is the same loop with any subset of the fixes switched on; with none it is
``first_try``, with all of them it equals ``reference.attention``. ``departures`` measures each
pitfall alone.
"""
from __future__ import annotations

import math

import torch

from course_lib.reference import attention, causal_mask, dropout_mask
from course_lib.testing import below

NEG_INF = -1e10     # the first try's "-infinity"
EPSILON = 1e-10     # the first try's guard added to every block's row sum
FIXES = ("scale", "mask", "tail", "dropout", "init")


def first_try(Q, K, V, B_r, B_c, dropout_p=0.0, generator=None):
    """A first block-by-block forward on (1, 1, N, d) tensors: Algorithm 1's loop, five pitfalls.

    Each pitfall is marked with its name in ``FIXES``; ``sketch_forward`` switches them off.
    """
    N_q, N_k = Q.shape[2], K.shape[2]
    T_r, T_c = N_q // B_r, N_k // B_c                    # pitfall "tail": rounds down
    O = torch.zeros_like(Q)
    l = torch.zeros_like(Q[..., :1])                     # (1, 1, N_q, 1)
    m = torch.full_like(Q[..., :1], NEG_INF)             # pitfall "init": a finite "-inf"
    for j in range(T_c):
        Kj, Vj = K[:, :, j * B_c:(j + 1) * B_c], V[:, :, j * B_c:(j + 1) * B_c]
        for i in range(T_r):
            r = slice(i * B_r, (i + 1) * B_r)
            Qi, Oi, li, mi = Q[:, :, r], O[:, :, r], l[:, :, r], m[:, :, r]
            S = Qi @ Kj.transpose(-1, -2)                # pitfall "scale": no 1/sqrt(d)
            S = S.masked_fill(S.ge(0.5), 0)              # pitfall "mask": a test on values
            m_block = S.amax(dim=-1, keepdim=True)
            P = torch.exp(S - m_block)
            l_block = P.sum(dim=-1, keepdim=True) + EPSILON   # pitfall "init": an epsilon
            PV = P @ Vj                                  # (1, 1, B_r, d)
            if dropout_p > 0:                            # pitfall "dropout": nn.Dropout on P·V
                keep = torch.rand(PV.shape, generator=generator, dtype=PV.dtype) >= dropout_p
                PV = PV * keep / (1 - dropout_p)
            m_new = torch.maximum(m_block, mi)
            alpha, beta = torch.exp(mi - m_new), torch.exp(m_block - m_new)
            l_new = alpha * li + beta * l_block
            O[:, :, r] = (li * alpha * Oi + beta * PV) / l_new
            l[:, :, r], m[:, :, r] = l_new, m_new
    return O


def sketch_forward(Q, K, V, q_block, kv_block, fixes=(), causal=False, dropout_p=0.0,
                   dropout_seed=None):
    """``first_try``'s loop on (1, 1, N, d) tensors (fp64 inside), with ``fixes`` applied.

    Without fixes it computes what ``first_try`` computes (dropout drawn from a generator seeded
    with ``dropout_seed``); ``causal`` and dropout are what the reference is asked to compute
    (the first try cannot express either correctly).
    """
    fixes = set(fixes)
    if fixes - set(FIXES):
        raise ValueError(f"unknown fixes {sorted(fixes - set(FIXES))}; choose from {FIXES}")
    Q, K, V = Q.double(), K.double(), V.double()
    N_q, N_k, d = Q.shape[2], K.shape[2], Q.shape[3]
    ceil_or_floor = math.ceil if "tail" in fixes else (lambda x: int(x))
    Tr, Tc = ceil_or_floor(N_q / q_block), ceil_or_floor(N_k / kv_block)
    sentinel = float("-inf") if "init" in fixes else NEG_INF
    visible = causal_mask(N_q, N_k)
    keep = (dropout_mask((1, 1, N_q, N_k), dropout_p, dropout_seed) if dropout_p > 0 else None)
    gen = torch.Generator().manual_seed(0 if dropout_seed is None else dropout_seed)

    def exp_sub(x, m):          # the fix: a max of -inf (nothing seen) contributes 0, not NaN
        if "init" in fixes:
            return torch.exp(x - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        return torch.exp(x - m)

    O = torch.zeros_like(Q)
    l = torch.zeros(Q.shape[:-1], dtype=Q.dtype)[..., None]          # (1, 1, N_q, 1)
    m = torch.full(Q.shape[:-1], sentinel, dtype=Q.dtype)[..., None]  # (1, 1, N_q, 1)
    for j in range(Tc):
        c = slice(j * kv_block, (j + 1) * kv_block)
        Kj, Vj = K[:, :, c], V[:, :, c]
        for i in range(Tr):
            r = slice(i * q_block, (i + 1) * q_block)
            Qi, Oi, li, mi = Q[:, :, r], O[:, :, r], l[:, :, r], m[:, :, r]
            S = Qi @ Kj.transpose(-1, -2)                            # (1, 1, B_r, B_c)
            if "scale" in fixes:
                S = S * d ** -0.5
            if "mask" not in fixes:
                S = S.masked_fill(S.ge(0.5), 0)                      # the first try's "mask"
            elif causal:
                S = S.masked_fill(~visible[r, c], sentinel)
            m_block = S.amax(dim=-1, keepdim=True)
            P = exp_sub(S, m_block)
            l_block = P.sum(dim=-1, keepdim=True) + (0.0 if "init" in fixes else EPSILON)
            if keep is not None and "dropout" in fixes:
                P = P * keep[:, :, r, c] / (1 - dropout_p)           # drop probabilities
            PV = P @ Vj                                              # (1, 1, B_r, d)
            if keep is not None and "dropout" not in fixes:          # nn.Dropout on P·V
                PV = PV * (torch.rand(PV.shape, generator=gen, dtype=PV.dtype) >= dropout_p)
                PV = PV / (1 - dropout_p)
            mi_new = torch.maximum(m_block, mi)
            alpha, beta = exp_sub(mi, mi_new), exp_sub(m_block, mi_new)
            li_new = alpha * li + beta * l_block
            inv = (torch.where(li_new > 0, 1 / li_new, torch.zeros_like(li_new))
                   if "init" in fixes else 1 / li_new)
            O[:, :, r] = li * inv * alpha * Oi + beta * inv * PV
            l[:, :, r], m[:, :, r] = li_new, mi_new
    return O


def departures(N_q=11, N_k=8, d=16, q_block=4, kv_block=3, dropout_p=0.2, seed=0) -> dict:
    """Max |O − reference| of the first try (all five pitfalls), with each single pitfall left
    unfixed, and with all fixed. The problem is causal with dropout and N_q > N_k (rows that
    see no key).

    Returns {label: max abs error} (``nan`` where the output has NaN).
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
               for n in (N_q, N_k, N_k))
    kw = {"causal": True, "dropout_p": dropout_p, "dropout_seed": seed + 1}
    ref = attention(q, k, v, **kw)

    def err(fixes):
        return (sketch_forward(q, k, v, q_block, kv_block, fixes, **kw) - ref).abs().max().item()

    out = {"first try": err(())}
    for name in FIXES:
        out[f"all fixed but {name}"] = err(set(FIXES) - {name})
    out["all fixed"] = err(FIXES)
    return out


#: Below this, a difference of two fp64 computations of the same thing is rounding.
ROUNDING = 1e-12


def departures_figure(errs=None):
    """Bar chart of ``departures()``: which detail costs how much (log scale).

    A detail that costs nothing shows as "< 1e-12" (``ROUNDING``), never by its last bits.
    """
    from matplotlib.figure import Figure

    errs = departures() if errs is None else errs
    fig = Figure(figsize=(7.5, 3.8), layout="constrained")
    ax = fig.subplots()
    labels = list(errs)
    vals = [errs[k] for k in labels]
    finite = [v for v in vals if math.isfinite(v) and v > ROUNDING]
    top = max(finite) * 30
    floor = ROUNDING / 100
    shown = [top if not math.isfinite(v) else max(v, ROUNDING) for v in vals]
    colors = ["C3" if not math.isfinite(v) or v >= ROUNDING else "C2" for v in vals]
    ax.barh(range(len(labels)), shown, color=colors)
    for y, v in enumerate(vals):
        text = ("NaN" if not math.isfinite(v) else
                f"{v:#.2g}" if v >= ROUNDING else f"{below(v, ROUNDING)} (rounding)")
        ax.text(shown[y] * 1.3, y, text, va="center", fontsize=10)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(floor, top * 100)
    ax.set(xlabel="max |O − O_reference|  (fp64, causal, dropout, N_q > N_k)",
           title="A first block loop: what each pitfall costs")
    return fig


FIGURES = {"06_sketch_pitfalls": departures_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
