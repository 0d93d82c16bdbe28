"""The score changes of attention's variants, drawn from the course's references.

Introduced in notebooks/15_attention_variants.ipynb (section 4). Three panels:

* softcap (Gemma 2): s ↦ c·tanh(s / c) and its slope 1 − tanh²(s / c), the factor the
  backward multiplies dS by (Gemma Team, "Gemma 2", 2024, https://arxiv.org/abs/2408.00118);
* ALiBi: the bias −m·|p − j| of ``masks.alibi_bias`` for the slopes m_h = 2^(−8h/H) of
  H = 8 heads (Press, Smith, Lewis, "Train Short, Test Long", 2022,
  https://arxiv.org/abs/2108.12409);
* a sink (gpt-oss): the share e^sink / (e^sink + Σ_j e^{s_j}) that a row gives to the sink as
  its scores fall, the reference's exp(sink − lse) (OpenAI, "gpt-oss-120b &
  gpt-oss-20b Model Card", 2025, https://arxiv.org/abs/2508.10925).
"""
from __future__ import annotations

import numpy as np
import torch

from course_lib import masks


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's slopes for ``n_heads`` heads (a power of 2): the geometric sequence that starts
    at 2^(−8/H) with that ratio (Press et al. 2022, section 3), fp32 (H,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


def sink_share(max_scores, sink: float = 0.0, n_keys: int = 8) -> np.ndarray:
    """The sink's share of a row's softmax, e^sink / (e^sink + Σ_j e^{s_j}), for rows of
    ``n_keys`` keys whose scores are ``max_score`` − 0, −0.5, −1, ... (one row per value). In
    NumPy, so that the figure does not move with PyTorch's CPU code paths; a test holds it equal
    to ``reference.attention_variants``'s exp(sink − lse)."""
    m = np.asarray(max_scores, dtype=np.float64)
    scores = m[:, None] - 0.5 * np.arange(n_keys)  # (rows, n_keys)
    lse = np.logaddexp(sink, np.logaddexp.reduce(scores, axis=-1))
    return np.exp(sink - lse)


def score_changes_figure(softcap: float = 50.0, heads: int = 8):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.6), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    s = np.linspace(-150, 150, 601)
    ax1.plot(s, s, color="0.6", ls="--", label="s (no cap)")
    ax1.plot(s, softcap * np.tanh(s / softcap), color="#4c72b0", lw=2.5,
             label=f"{softcap:g}·tanh(s / {softcap:g})")
    ax1.set(xlabel="scaled score s", ylabel="score after the cap", ylim=(-110, 110),
            title=f"softcap c = {softcap:g} (Gemma 2's attention)")
    slope = ax1.twinx()
    slope.plot(s, 1 - np.tanh(s / softcap) ** 2, color="#dd8452", lw=2,
               label="slope 1 − tanh²(s / c) (right axis)")
    slope.set(ylim=(0, 2.2), yticks=[0, 0.5, 1])
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = slope.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=10)

    n = 64
    slopes = alibi_slopes(heads)
    bias = masks.alibi_bias(slopes, 1, n)[0, :, 0, :].numpy()  # (H, n): one query at p = n − 1
    dist = (n - 1) - np.arange(n)
    for h in range(0, heads, 2):
        ax2.plot(dist, bias[h], lw=2, label=f"head {h + 1}: m = 1/{round(1 / float(slopes[h]))}")
    ax2.set(xlabel="distance p − j", ylabel="bias added to the score", xlim=(0, n - 1),
            title=f"ALiBi: −m·|p − j|, H = {heads}")
    ax2.legend(loc="lower left", fontsize=10)

    top = np.linspace(-8, 6, 141)
    for sink in (-2.0, 0.0, 2.0):
        ax3.plot(top, sink_share(top, sink), lw=2, label=f"sink = {sink:g}")
    ax3.set(xlabel="the row's largest score", ylabel="the sink's share of the row",
            ylim=(0, 1.02), title="a sink: e^sink / (e^sink + Σ e^s)")
    ax3.legend(loc="upper right", fontsize=10)
    return fig


FIGURES = {"15_score_changes": score_changes_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
