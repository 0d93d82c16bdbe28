"""A unified max for split softmaxes, in NumPy: FlashDecoding++'s idea, with the course's own
rule for when to fall back.

Introduced in notebooks/13_paged_attention.ipynb (after the split-KV merge of
notebooks/12_flash_decoding.ipynb).

Flash-Decoding computes each split's partial softmax with the split's *own* maximum m_s, so the
merge must rescale every partial result by e^{m_s − m} (or e^{lse_s − lse}) once the global
maximum is known: a synchronisation between splits. FlashDecoding++ (K. Hong et al.,
"FlashDecoding++: Faster Large Language Model Inference on GPUs", 2023, §3 "Asynchronized
softmax with unified max value", https://arxiv.org/abs/2311.01282) observes that softmax is
unchanged by *any* shift φ,

    softmax(x)_i = e^{x_i − φ} / Σ_j e^{x_j − φ},

so if every split subtracts the same fixed φ the partial numerators Σ e^{x−φ}·v and
denominators Σ e^{x−φ} just *add up*: no per-split max, no rescaling, no waiting. The paper
picks φ for each model from the statistics of the softmax inputs it measured on real models
(its Figure 5), and recomputes a row with the synchronised method when its values fall outside
the range that φ was chosen for.

What is the course's own here (a variant connected to that idea, not the paper's method): the
test for when to fall back. ``safe_window`` derives a window for a row's largest x − φ from the
exponential's floating-point range alone: above ln(max float) − ``margin`` (10.09 in fp16,
87.7 in fp32) the largest term e^{x−φ} is about to overflow; below ln(smallest normal) +
``headroom`` (−3.70 in fp16) the terms near the row's maximum are already subnormal. A row
whose largest x − φ leaves ``[lo, hi]`` is recomputed with the ordinary safe (synchronised)
method: the *fallback*. The fallback rates of ``fallback_rate`` and its figure are for scores
drawn from a normal distribution, not from a model.

Everything here is plain NumPy on one row of scores ``s`` (N,) and values ``v`` (N, D).
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

__all__ = ["exp_overflow_threshold", "safe_window", "synchronized_split_attention",
           "unified_max_attention", "fallback_rate", "FIGURES"]


def exp_overflow_threshold(dtype=np.float16) -> float:
    """The largest x with e^x finite in ``dtype``: ln(max float).

    >>> round(exp_overflow_threshold(np.float16), 2), round(exp_overflow_threshold(np.float32), 1)
    (11.09, 88.7)
    """
    return float(np.log(np.finfo(dtype).max))


def safe_window(dtype=np.float16, margin: float = 1.0, headroom: float = 6.0
                ) -> tuple[float, float]:
    """(lo, hi): the range a row's largest x − φ must stay in (the course's own rule).

    Above ``hi`` = ln(max float) − ``margin`` the largest term e^{x−φ} is about to overflow.
    Below ``lo`` = ln(smallest normal) + ``headroom`` the terms within e^{−headroom} of the
    row's largest would already be subnormal, losing precision, and far below it the whole row
    rounds to zero. The partial sums themselves are kept in fp32 (as a kernel's accumulators).

    >>> [round(x, 2) for x in safe_window(np.float16)]
    [-3.7, 10.09]
    >>> [round(x, 1) for x in safe_window(np.float32)]
    [-81.3, 87.7]
    """
    hi = exp_overflow_threshold(dtype) - margin
    lo = float(np.log(np.finfo(dtype).tiny)) + headroom
    return float(lo), float(hi)


def synchronized_split_attention(s, v, n_splits: int):
    """Flash-Decoding's way: each split keeps its own max; the merge rescales by e^{m_s − m}.

    Returns (o, lse) in float64 for one row: s (N,), v (N, D).
    """
    s = np.asarray(s, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    parts = []
    for idx in np.array_split(np.arange(s.size), n_splits):
        if idx.size == 0:
            continue
        m_s = s[idx].max()
        p = np.exp(s[idx] - m_s)
        parts.append((m_s, p.sum(), p @ v[idx]))  # (m_s, l_s, unnormalised o_s)
    m = max(m_s for m_s, _, _ in parts)  # the synchronisation point: every split's max
    l = sum(l_s * np.exp(m_s - m) for m_s, l_s, _ in parts)
    o = sum(o_s * np.exp(m_s - m) for m_s, _, o_s in parts)
    return o / l, m + np.log(l)


def unified_max_attention(s, v, phi: float, n_splits: int, dtype=np.float16,
                          window: tuple[float, float] | None = None):
    """FlashDecoding++'s idea: every split subtracts the same fixed ``phi`` and the partial sums
    are simply added. The exponentials are computed in ``dtype`` (as a kernel would).

    Returns (o, fell_back): when any x − φ leaves the safe ``window`` (default
    ``safe_window(dtype)``), the row is recomputed with ``synchronized_split_attention`` and
    ``fell_back`` is True.
    """
    s = np.asarray(s, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    lo, hi = safe_window(dtype) if window is None else window
    shifted = s - phi
    if shifted.max() > hi or shifted.max() < lo:  # would overflow, or the row would vanish
        return synchronized_split_attention(s, v, n_splits)[0], True
    num = np.zeros(v.shape[1])
    den = 0.0
    for idx in np.array_split(np.arange(s.size), n_splits):  # independent: no max exchanged
        p = np.exp(shifted[idx].astype(dtype)).astype(np.float64)
        den += p.sum()
        num += p @ v[idx]  # fp32 (here fp64) accumulators, as in a kernel
    return num / den, False


def fallback_rate(phi: float, mean: float = 0.0, std: float = 3.0, n_keys: int = 1024,
                  rows: int = 2000, dtype=np.float16, seed: int = 0) -> float:
    """Fraction of rows whose logits (normal, ``mean``, ``std``) leave φ's safe window
    (``safe_window``: the course's rule)."""
    rng = np.random.default_rng(seed)
    lo, hi = safe_window(dtype)
    top = (rng.standard_normal((rows, n_keys)) * std + mean).max(axis=1) - phi
    return float(np.mean((top > hi) | (top < lo)))


def unified_max_figure() -> Figure:
    """Fallback rate against φ for fp16 and fp32 exponentials, logits ~ N(0, 3²), 1024 keys."""
    fig = Figure(figsize=(6.4, 4), layout="constrained")
    ax = fig.subplots()
    phis = np.linspace(-100, 110, 211)
    for dtype, color in ((np.float16, "tab:red"), (np.float32, "tab:blue")):
        rates = [fallback_rate(p, dtype=dtype, rows=400) for p in phis]
        ax.plot(phis, np.array(rates) * 100, color=color, label=np.dtype(dtype).name)
    ax.set(xlabel="unified max φ", ylabel="rows recomputed (%)",
           title="Unified max with the course's safe window:\n"
                 "rows that fall back, logits ~ N(0, 3²), 1024 keys")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"13_unified_max_fallback": unified_max_figure}
