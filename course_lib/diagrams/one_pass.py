"""The 1-pass attention recurrence: the state (m, ℓ, o) flowing key by key.

Introduced in notebooks/05_one_pass_attention.ipynb. One query row; each step reads one key and
one value from memory, computes the score x_j and updates the running maximum m, the normaliser
ℓ and the surrogate output o (the attention output over the keys seen so far). Nothing of size
N is written; o and lse = m + log ℓ are written once, after the last key. The recurrence is
online softmax's (Milakov & Gimelshein 2018, https://arxiv.org/abs/1805.02867) carried on to the
output, as in Rabe & Staats (2021, https://arxiv.org/abs/2112.05682) and FlashAttention (Dao et
al. 2022, https://arxiv.org/abs/2205.14135). The numbers in the picture are computed by
``trace``, for scalar values (d = 1) so that o fits in a box.
"""
from __future__ import annotations

import math

FONT = 12
#: The example: four scores x_j = sm_scale·q·k_j (already scaled) and four scalar values v_j.
SCORES = (0.5, 2.0, 1.0, 3.0)
VALUES = (1.0, -1.0, 2.0, 0.5)


def trace(scores=SCORES, values=VALUES) -> list[dict]:
    """The state after each key: [{"m", "l", "o", "rescale"}], starting from (−∞, 0, 0).

    ``rescale`` is e^(m_old − m_new), the factor the old sum and output are multiplied by.
    """
    m, l, o = -math.inf, 0.0, 0.0
    states = [{"m": m, "l": l, "o": o, "rescale": None}]
    for x, v in zip(scores, values):
        m_new = max(m, x)
        alpha = math.exp(m - m_new)                  # 0 on the first key (m = −∞)
        l_new = l * alpha + math.exp(x - m_new)
        o = o * (l * alpha / l_new) + math.exp(x - m_new) / l_new * v
        m, l = m_new, l_new
        states.append({"m": m, "l": l, "o": o, "rescale": alpha})
    return states


def _box(ax, x, y, w, h, color, edge, lw=1.6, ls="-"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.15",
                                facecolor=color, edgecolor=edge, lw=lw, ls=ls))


def _arrow(ax, xy0, xy1, color, lw=2.2):
    ax.annotate("", xy=xy1, xytext=xy0,
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": lw,
                            "mutation_scale": 16, "shrinkA": 0, "shrinkB": 0})


def one_pass_figure(scores=SCORES, values=VALUES):
    """Memory on top (k_j, v_j read once each; o and lse written once at the end), the state
    boxes on chip below with their values after each key, and the update rules underneath."""
    from matplotlib.figure import Figure

    states = trace(scores, values)
    weights = [math.exp(x - max(scores)) for x in scores]
    exact = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    if abs(states[-1]["o"] - exact) > 1e-12:
        raise AssertionError("the recurrence does not give softmax(x)·v")
    n = len(scores)

    fig = Figure(figsize=(13.5, 7.0), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 29.6)
    ax.set_ylim(-0.2, 12)
    ax.set_axis_off()

    gap = 5.4
    state_x = [0.3 + gap * j for j in range(n + 1)]            # left edges of the state boxes
    w_state, y_state, h_state = 3.6, 4.4, 3.0
    step_x = [sx + w_state + (gap - w_state) / 2 for sx in state_x[:-1]]   # arrow mid-points

    # memory: one key and one value per step, the output at the end
    _box(ax, 0.1, 8.6, 29.4, 3.1, "#fbeeee", "#b03a2e")
    ax.text(0.4, 11.25, "memory (HBM)", fontsize=FONT, weight="bold", color="#8a2a20",
            va="center")
    for j, x in enumerate(step_x, start=1):
        _box(ax, x - 1.25, 9.0, 2.5, 1.6, "white", "0.3")
        ax.text(x, 9.8, f"$k_{j},\\ v_{j}$", ha="center", va="center", fontsize=FONT + 1)
    out_x = state_x[-1] + w_state + 1.9
    _box(ax, out_x - 1.6, 9.0, 3.2, 1.6, "#f4c7c3", "0.3")
    ax.text(out_x, 9.8, "o, lse", ha="center", va="center", fontsize=FONT + 1, weight="bold")

    # on chip: the state after each key
    _box(ax, 0.1, 3.3, 29.4, 4.7, "#eef4fb", "#2f6db5", lw=1.2, ls="--")
    ax.text(0.4, 3.7, "on chip: q and the state (m, ℓ, o): two numbers and a d-vector per row",
            fontsize=FONT, color="#1f4f8a", va="center")
    for j, (sx, st) in enumerate(zip(state_x, states)):
        last = j == n
        _box(ax, sx, y_state, w_state, h_state, "#d5ecd9" if last else "white",
             "#3f8f52" if last else "0.3")
        m = "−∞" if st["m"] == -math.inf else f"{st['m']:.2f}"
        ax.text(sx + w_state / 2, y_state + h_state - 0.45, f"after key {j}" if j else "start",
                ha="center", va="center", fontsize=FONT - 1, color="0.35")
        ax.text(sx + w_state / 2, y_state + 1.05,
                f"m = {m}\nℓ = {st['l']:.3f}\no = {st['o']:.3f}", ha="center", va="center",
                fontsize=FONT, linespacing=1.25)
    for j, x in enumerate(step_x, start=1):
        st = states[j]
        _arrow(ax, (state_x[j - 1] + w_state, y_state + 1.45), (state_x[j], y_state + 1.45),
               "0.25")
        _arrow(ax, (x, 9.0), (x, y_state + 1.6), "#2f6db5", lw=1.8)
        ax.text(x + 0.15, 8.3, f"reads $k_{j}, v_{j}$: $x_{j}$ = {scores[j - 1]:g}",
                fontsize=FONT - 1,
                va="center", ha="left", color="#2f6db5")
        ax.text(x, y_state + 0.55, f"×{st['rescale']:.2f}", ha="center", va="center",
                fontsize=FONT - 1, color="#b03a2e")
    _arrow(ax, (state_x[-1] + w_state, y_state + h_state - 0.4), (out_x, 9.0), "#b03a2e", lw=2.6)
    ax.text(out_x + 0.2, 6.6, "write\nonce", fontsize=FONT - 1, ha="left", va="center",
            color="#b03a2e")

    # the rules
    ax.text(0.3, 2.55, "each step:", fontsize=FONT, weight="bold", va="center")
    ax.text(2.6, 2.55, r"$x_j = \mathrm{sm\_scale}\cdot q\cdot k_j,\qquad"
            r"m_j = \max(m_{j-1}, x_j),\qquad"
            r"\ell_j = \ell_{j-1}\,e^{m_{j-1}-m_j} + e^{x_j-m_j}$", fontsize=FONT + 1,
            va="center")
    ax.text(2.6, 1.25, r"$o_j = o_{j-1}\,\dfrac{\ell_{j-1}\,e^{m_{j-1}-m_j}}{\ell_j}"
            r" + \dfrac{e^{x_j-m_j}}{\ell_j}\,v_j$", fontsize=FONT + 2, va="center")
    ax.text(14.2, 1.25, "red: the rescale $e^{m_{j-1}-m_j}$ (1 when the max stays)\n"
            f"values here: v = {', '.join(f'{v:g}' for v in values)} (d = 1); "
            f"the last o equals softmax(x)·v", fontsize=FONT - 1, va="center", color="0.25")
    return fig


FIGURES = {"05_one_pass_recurrence": one_pass_figure}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
