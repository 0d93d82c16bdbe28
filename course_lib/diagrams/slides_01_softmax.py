"""Slide figures of deck 01 (softmax): why attention matters, overflow, the rescale as a build.

Drawn for slides/01_softmax.md at slide size (``slides_style``): where attention sits in a
transformer layer, what an N × N score matrix costs as the context grows (for the capstone's
LLaMA shape, ``course_lib.hf.llama_1b_config``), where naive softmax breaks, and the steps of
online softmax one per slide (``course_lib.widgets.softmax_steps.trace``, the notebook's
stepper). Introduced with notebooks/01_softmax.ipynb.
"""
from __future__ import annotations

import math

import numpy as np

from course_lib.diagrams.slides_style import (
    C_MAX,
    C_NEW,
    C_OLD,
    GREY,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    arrow,
    blank,
    box,
    legend,
    slide_figure,
    style_axes,
)

# ------------------------------------------------------------------------------------------
# Why: where attention sits, and what long context costs
# ------------------------------------------------------------------------------------------


def transformer_layer():
    """One decoder layer: norm → attention → add, norm → MLP → add; attention alone mixes
    tokens, through softmax(QKᵀ)V."""
    fig = slide_figure(1160, 380)
    ax = fig.subplots()
    blank(ax, (0, 11.6), (0, 3.8))
    y, h = 1.3, 0.9
    box(ax, 0.05, y, 1.1, h, "tokens\nN × d", color="0.95")
    box(ax, 1.45, y, 0.9, h, "norm", color="0.92")
    box(ax, 2.65, 0.55, 4.7, 2.35, "", color="#fdebd0", edge=C_NEW, lw=2.5)
    ax.text(5.0, 2.5, "attention", ha="center", fontsize=TITLE_PT, weight="bold",
            color="#a04000")
    box(ax, 2.75, y, 1.0, h, "Q, K, V\n= x·W", color="white", fontsize=MIN_PT)
    box(ax, 4.0, y - 0.1, 2.15, h + 0.2, "softmax(QKᵀ/√d)\n· V", color="white",
        fontsize=LABEL_PT, weight="bold")
    box(ax, 6.4, y, 0.85, h, "O·W", color="white", fontsize=MIN_PT)
    box(ax, 7.65, y, 0.6, h, "+", color="0.95", fontsize=TITLE_PT)
    box(ax, 8.5, y, 0.9, h, "norm", color="0.92")
    box(ax, 9.65, y, 0.9, h, "MLP", color="#d6eaf8", edge=C_OLD, lw=2)
    box(ax, 10.85, y, 0.6, h, "+", color="0.95", fontsize=TITLE_PT)
    for a, b in ((1.15, 1.45), (2.35, 2.75), (3.75, 4.0), (6.15, 6.4), (7.25, 7.65),
                 (8.25, 8.5), (9.4, 9.65), (10.55, 10.85)):
        arrow(ax, (a, y + h / 2), (b, y + h / 2))
    for a, b in ((1.3, 7.95), (8.38, 11.15)):   # the residual connections
        ax.plot([a, a, b], [y + h / 2, 3.45, 3.45], color=GREY, lw=1.5)
        arrow(ax, (b, 3.45), (b, y + h), color=GREY, lw=1.5)
    ax.text(0.05, 0.1, "× every layer (16 in the capstone's LLaMA)", fontsize=LABEL_PT,
            color="0.3")
    ax.text(7.65, 0.1, "only attention mixes tokens:\nrow i of QKᵀ scores token i\n"
            "against every token", fontsize=MIN_PT, color="#a04000", va="bottom")
    return fig


def _llama_shape():
    """Layers, heads, head dim, and the weights' FLOPs per token and layer of the capstone's
    LLaMA (2 FLOPs per weight of the projections and the MLP)."""
    from course_lib.hf import llama_1b_config

    cfg = llama_1b_config()
    d, h_kv = cfg.hidden_size, cfg.num_key_value_heads
    D = d // cfg.num_attention_heads
    proj = d * d * 2 + 2 * d * h_kv * D          # W_q, W_o; W_k, W_v (GQA)
    mlp = 3 * d * cfg.intermediate_size
    return {"layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "D": D,
            "weight_flops": 2 * (proj + mlp)}


def long_context_numbers() -> dict:
    """What one N × N score matrix costs, and where attention's FLOPs pass the weights'.

    * ``s_bytes(N)``: one head's S (or P) in fp16, 2·N² bytes;
    * a token that attends to N keys costs 4·N·H·D FLOPs per layer (QKᵀ and PV, 2·H·D each
      per key), against the weights' 2 FLOPs per parameter of the layer; ``crossover_tokens``
      is the N where the two are equal.
    """
    s = _llama_shape()
    attn_per_n = 4 * s["heads"] * s["D"]
    return {**s, "attn_flops_per_key": attn_per_n,
            "crossover_tokens": s["weight_flops"] / attn_per_n,
            "s_bytes_128k": 2 * 131072**2}


def why_long_context():
    """Left: one head's N × N matrix in fp16 against an H100's 80 GiB. Right: FLOPs per token
    and layer of the capstone's LLaMA, weights against attention, as the context grows."""
    nums = long_context_numbers()
    fig = slide_figure(1160, 370)
    ax1, ax2 = fig.subplots(1, 2)
    N = np.logspace(np.log10(1024), np.log10(1 << 20), 200)
    ax1.loglog(N, 2 * N**2 / 2**30, color=C_MAX, lw=3, label="one head's S: 2·N² bytes")
    ax1.axhline(80, color="0.3", ls="--", lw=1.5)
    ax1.text(1100, 80 * 1.6, "one H100: 80 GiB", fontsize=MIN_PT, color="0.3", va="bottom")
    ax1.plot([131072], [nums["s_bytes_128k"] / 2**30], "o", color=C_MAX, ms=9)
    ax1.annotate(f"128k tokens: {nums['s_bytes_128k'] / 2**30:.0f} GiB\nper head, per layer",
                 (131072, nums["s_bytes_128k"] / 2**30), xytext=(12, -48),
                 textcoords="offset points", fontsize=MIN_PT)
    ax1.set(xlabel="context length N (tokens)", ylabel="GiB", title="memory: N²",
            ylim=(1e-3, 3e4))
    ticks = [1024, 8192, 65536, 1 << 20]
    ax1.set_xticks(ticks, ["1k", "8k", "64k", "1M"])
    ax1.minorticks_off()
    style_axes(ax1)
    ax2.loglog(N, np.full_like(N, nums["weight_flops"] / 1e6), color=C_OLD, lw=3,
               label="weights (projections, MLP)")
    ax2.loglog(N, nums["attn_flops_per_key"] * N / 1e6, color=C_NEW, lw=3,
               label="attention over N keys: QKᵀ, PV")
    ax2.plot([nums["crossover_tokens"]] * 2, [4, 2e3], color="0.3", ls=":", lw=1.5)
    ax2.text(nums["crossover_tokens"] * 1.1, 12, f"equal at\n{nums['crossover_tokens'] / 1e3:.0f}k"
             " tokens", fontsize=MIN_PT)
    ax2.set(xlabel="context length N (tokens)", ylabel="MFLOP per token and layer",
            title="time: N per token, N² per sequence", ylim=(4, 3e5))
    ax2.set_xticks(ticks, ["1k", "8k", "64k", "1M"])
    ax2.minorticks_off()
    style_axes(ax2)
    legend(ax2, loc="upper left")
    return fig


# ------------------------------------------------------------------------------------------
# Overflow
# ------------------------------------------------------------------------------------------

def overflow():
    """Max error of naive and safe softmax of a row shifted by c, in float16 and float32:
    the same row for every c, so softmax should not change; naive breaks (NaN) past e^x's
    overflow (``softmax.exp_limits``). Errors below ``ROUNDING_ULPS`` ε are rounding, whose last
    bits differ between CPUs: they are drawn at that bound, and the bound is drawn and
    labelled."""
    from course_lib import softmax as sm

    fig = slide_figure(1160, 262)
    ax = fig.subplots()
    z = np.random.default_rng(0).standard_normal(16)
    shifts = np.linspace(-120, 120, 241)
    top = shifts + z.max()   # the row's largest logit
    for dtype, color in ((np.float16, C_MAX), (np.float32, C_OLD)):
        bound = sm.ROUNDING_ULPS * np.finfo(dtype).eps
        for fn, ls, label in ((sm.naive_softmax, "-", "naive"), (sm.safe_softmax, "--", "safe")):
            errs = []
            for c in shifts:
                xs = (c + z).astype(dtype)
                ref = sm.safe_softmax(xs.astype(np.float64))
                with np.errstate(all="ignore"):
                    err = np.abs(fn(xs).astype(np.float64) - ref).max()
                errs.append(err if np.isfinite(err) else np.nan)
            errs = np.maximum(np.asarray(errs), bound)  # below: rounding (CPU-dependent bits)
            ax.semilogy(top, errs, color=color, ls=ls, lw=3 if ls == "-" else 2.5)
            broken = np.isnan(errs)
            ax.plot(top[broken], np.full(broken.sum(), 3.0), "|", color=color, ms=14)
        ax.axhline(bound, color=color, ls=":", lw=1.2)
        ax.text(15 if dtype == np.float16 else -88, bound * 1.7,
                f"{np.dtype(dtype).name}: ≤ {sm.ROUNDING_ULPS} ε, rounding",
                color=color, fontsize=MIN_PT)
        lim = sm.exp_limits(dtype)["overflow_above"]
        ax.axvline(lim, color=color, ls=":", lw=1.5)
        ax.text(lim + 2, 3e-5 if dtype == np.float16 else 2e-4, f"e^x = inf\npast {lim:.2f}",
                color=color, fontsize=MIN_PT)
    ax.set_yticks([1e-6, 1e-3, 3.0], ["1e-6", "1e-3", "NaN"])
    ax.set(xlabel="largest logit of the row (the same row, shifted)", ylabel="max error",
           ylim=(1e-7, 10))
    style_axes(ax)
    # colour is the dtype (the labels of the dotted bounds say which), line style the algorithm
    from matplotlib.lines import Line2D

    legend(ax, handles=[Line2D([], [], color="0.2", lw=3, label="naive softmax"),
                        Line2D([], [], color="0.2", lw=2.5, ls="--", label="safe softmax")],
           loc="lower left", bbox_to_anchor=(0.15, 0), ncols=2, borderaxespad=0.1,
           handlelength=1.6, columnspacing=1.2)
    return fig


# ------------------------------------------------------------------------------------------
# The online softmax, one step per slide
# ------------------------------------------------------------------------------------------

def _x(j: int) -> str:
    """x_j with j as Unicode subscript digits (x₂, x₁₀): plain text, so that the Chinese twin,
    drawn in a CJK font, shows it the same way (mathtext has no CJK glyphs)."""
    return "x" + str(j).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))


def _step(x, k: int, block_size: int = 1, width: float = 1160, height: float = 440):
    """Step ``k`` of the (blocked) online softmax of the row ``x``: left the row with m_old and
    m_new, right each term e^{x_j − m_new} (dotted: the same terms before the rescale) and the
    update of d written out."""
    from course_lib.widgets.softmax_steps import trace

    x = np.asarray(x, dtype=float)
    steps = trace(x, block_size)
    st = steps[k]
    j = np.arange(x.size)
    seen, current = j < st.lo, (j >= st.lo) & (j < st.hi)
    fig = slide_figure(width, height)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(j, x, color=np.where(current, C_NEW, np.where(seen, C_OLD, "0.85")))
    if st.m_old != -math.inf:
        ax1.axhline(st.m_old, color=C_OLD, ls="--", lw=2, label=f"m before: {st.m_old:.1f}")
    ax1.axhline(st.m_new, color=C_MAX, lw=3, label=f"m after: {st.m_new:.1f}")
    legend(ax1, loc="upper left", ncols=2, handlelength=1.5)
    which = (f"{_x(st.lo)} = {x[st.lo]:.1f}" if st.hi - st.lo == 1
             else f"{_x(st.lo)}…{_x(st.hi - 1)}")
    ax1.set(title=f"step {k + 1} of {len(steps)}: {which} enters", ylim=(-1.6, 6.4),
            xticks=j, xlabel="j")
    style_axes(ax1, grid=False)

    done = j < st.hi
    terms = np.where(done, np.exp(x - st.m_new), 0.0)
    ax2.bar(j, terms, color=np.where(current, C_NEW, C_OLD))
    if st.m_old != -math.inf and st.m_old != st.m_new:
        before = np.exp(x - st.m_old)
        ax2.bar(j[seen], before[seen], fill=False, edgecolor="0.25", ls=":", lw=2)
    alpha = st.rescale
    if st.m_old == -math.inf:
        lines = [f"d = {st.d_new:.3f}"]
    else:
        lines = [f"α = e^(m before − m after) = {alpha:.3f}",
                 f"d = {st.d_old:.3f} × {alpha:.3f} + {st.d_block * st.block_scale:.3f}"
                 f" = {st.d_new:.3f}"]
        if st.m_old == st.m_new:
            lines[0] = "max unchanged: α = 1"
        else:
            lines.append("dotted: the old terms before × α")
    ax2.text(0.02, 0.97, "\n".join(lines), transform=ax2.transAxes, ha="left", va="top",
             fontsize=LABEL_PT, color="black", linespacing=1.4)
    ax2.set(title="terms e^(xⱼ − m); d is their sum", ylim=(0, 1.95), xticks=j, xlabel="j")
    style_axes(ax2, grid=False)
    return fig


def _demo_row():
    from course_lib.widgets.softmax_steps import DEMO_ROW

    return DEMO_ROW


def rescale_steps() -> tuple[int, ...]:
    """The steps the deck shows (0-based): the max stays, the max jumps, the last step."""
    return (2, 3, len(_demo_row()) - 1)


FIGURES = {
    "slides_01_transformer_layer": transformer_layer,
    "slides_01_why_long_context": why_long_context,
    "slides_01_overflow": overflow,
    **{f"slides_01_rescale_{i + 1}": (lambda k=k: _step(_demo_row(), k))
       for i, k in enumerate(rescale_steps())},
    "slides_01_blocked_step": lambda: _step(_demo_row(), 1, block_size=4, height=420),
}
