"""The capstone's pictures: how transformers' calls reach the course's kernels, and the measured
result, a LLaMA with the course's kernels against the same LLaMA with PyTorch's SDPA, prefill and
decode, from the stored run.

Introduced in notebooks/14_llama_capstone.ipynb (sections 1 and 6). The result is drawn from
course_lib/data/llama.json (written by the notebook's GPU cells, ``course_lib.hf.benchmark``):
per prompt length, the prefill time (one forward over the prompt) and the decode time per
generated token, with ``attn_implementation="course_kernels"`` and ``"sdpa"`` on one model with
the same weights. Both sides use one harness (``HARNESS``: ``hf.time_prefills_in_turns``
and ``hf.time_decodes_in_turns``), named in every title. ``slides_capstone_result`` is the same
picture drawn for a slide (``course_lib.diagrams.slides_style``).

``llama_routes_figure`` (section 1 of the same notebook) draws how a call of transformers reaches
the course's kernels, after ``course_lib/hf/attention.py``: the name ``hf.register`` gives the
attention function and the mask function, the mask function that runs once per forward
(``course_attention_mask``: no mask, key counts or key ranges; a mask with a hole refused), the
attention function that every layer calls (``course_attention_forward``) and the kernel it picks
per call, in the order of its tests.
"""
from __future__ import annotations

from course_lib.diagrams import slides_style as st

#: How course_lib.hf.benchmark times both sides (time_prefills_in_turns, time_decodes_in_turns).
HARNESS = ("both sides eager PyTorch, in turns, wall clock between torch.cuda.synchronize() "
           "calls; prefill: median of {pairs} forwards; decode: median of {steps} steps of one "
           "token")
SIDES = (("course_kernels", "course kernels (flash_attn_v2 + flash_decode)", "#c0392b"),
         ("sdpa", "SDPA (PyTorch)", "#2e86c1"))
PHASES = (("prefill", "prefill: one forward over the prompt", "ms"),
          ("decode", "decode: per generated token", "ms per token"))


def _model_line(result: dict) -> str:
    cfg = result["config"]
    gpu = result.get("environment", {}).get("gpu", "a GPU")
    return (f"LLaMA, {result['parameters'] / 1e9:.2f} B parameters ({cfg['num_hidden_layers']} "
            f"layers, H {cfg['num_attention_heads']}, H_kv {cfg['num_key_value_heads']}, "
            f"D {cfg['head_dim']}), {result['dtype']}, batch {result['batch']}, on {gpu}")


def _panels(fig, result: dict, fontsize: float, short: bool = False):
    import numpy as np

    rows = result["rows"]
    prompts = [r["prompt"] for r in rows]
    x = np.arange(len(prompts))
    axes = fig.subplots(1, 2)
    for ax, (phase, title, unit) in zip(axes, PHASES):
        for i, (side, label, color) in enumerate(SIDES):
            ms = [r[f"{phase}_ms_{side}"] for r in rows]
            bars = ax.bar(x + (i - 0.5) * 0.38, ms, width=0.38, color=color,
                          label=label.split(" (")[0] if short else label)
            ax.bar_label(bars, labels=[f"{v:.1f}" for v in ms], fontsize=fontsize, padding=2)
        ax.set_xticks(x, [f"{p:,}" for p in prompts])
        ax.set_xlabel("prompt length (tokens)", fontsize=fontsize)
        ax.set_ylabel(unit, fontsize=fontsize)
        ax.set_title(title, fontsize=fontsize + 1)
        ax.tick_params(labelsize=fontsize)
        ax.margins(y=0.15)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.grid(axis="y", alpha=0.3)
    return axes


def llama_result_figure(result: dict | None = None):
    """Notebook figure: prefill and decode time per prompt length, both sides, harness in the
    title. ``result``: a llama.json-shaped dict (default: the stored one; None if none)."""
    from matplotlib.figure import Figure

    from course_lib.bench.common import load_result

    result = load_result("llama") if result is None else result
    if result is None:
        return None
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    axes = _panels(fig, result, fontsize=11)
    axes[0].legend(fontsize=11, loc="upper left", frameon=False)
    harness = HARNESS.format(pairs=result["pairs"], steps=result["decode_steps"])
    fig.suptitle(_model_line(result) + "\n" + harness.replace("; prefill", ";\nprefill"),
                 fontsize=11)
    return fig


def slides_capstone_result_figure():
    """Slide figure (1160 × 460 slide px): the same two panels, text at ``MIN_PT`` or larger."""
    from course_lib.bench.common import load_result

    result = load_result("llama")
    if result is None:
        return None
    fig = st.slide_figure(1160, 460)
    axes = _panels(fig, result, fontsize=st.MIN_PT, short=True)
    st.legend(axes[0], loc="upper left")
    gpu = result.get("environment", {}).get("gpu", "a GPU").replace("NVIDIA ", "")
    fig.suptitle(f"LLaMA {result['parameters'] / 1e9:.2f} B, {result['dtype']}, batch "
                 f"{result['batch']}, {gpu}: both sides eager PyTorch, wall clock",
                 fontsize=st.TITLE_PT)
    return fig


# --- how a call of transformers reaches the course's kernels ----------------------------------

MONO = "DejaVu Sans Mono"
C_HF = "#eaf2f8"      # transformers' code
C_COURSE = "#fdebd0"  # course_lib.hf
C_KERNEL = "#d5f5e3"  # the course's kernels
C_REFUSED = "#fadbd8"  # NotImplementedError
ROUTE_PT = 12.5       # the smallest text of the figure
NAME_PT = 13.5


def _node(ax, x, y, w, h, name, lines, color, name_pt=NAME_PT):
    """A box: ``name`` (code, monospace) on top, ``lines`` (prose) under it."""
    st.box(ax, x, y, w, h, color=color, lw=1.4)
    top = y + h - 0.2
    ax.text(x + w / 2, top, name, ha="center", va="top", fontsize=name_pt, family=MONO,
            weight="bold")
    if lines:
        ax.text(x + w / 2, top - 0.4, "\n".join(lines), ha="center", va="top",
                fontsize=ROUTE_PT, linespacing=1.3)


def llama_routes_figure():
    """Notebook figure (section 1): how transformers' calls reach the course's kernels.

    Drawn after ``course_lib/hf/attention.py``: ``register`` puts ``course_attention_forward``
    and ``course_attention_mask`` under one name in transformers' two registries; LLaMA's model
    looks the mask function up once per forward, every attention layer looks the attention
    function up. The mask function refuses a mask with a hole. The attention function refuses
    dropout, then sends key ranges (a padded batch) to ``flash_attn_varlen``, a decode step (at
    most ``DECODE_MAX_QUERIES`` new tokens against a longer cache, no gradient) to
    ``flash_decode`` and every other call to ``flash_attn_v2``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    W, H = 12.6, 8.3
    fig = Figure(figsize=(W, H))
    ax = fig.add_axes((0, 0, 1, 1))
    st.blank(ax, (0, W), (0, H))
    dark, red = dict(color="0.25", lw=1.6), dict(color="#c0392b", lw=1.6)

    x = 0.1  # the legend: whose code each box is
    for color, label in ((C_HF, "transformers"), (C_COURSE, "course_lib/hf/attention.py"),
                         (C_KERNEL, "the course's kernels"), (C_REFUSED, "refused with an error")):
        ax.add_patch(Rectangle((x, H - 0.42), 0.32, 0.32, facecolor=color, edgecolor="0.25"))
        ax.text(x + 0.45, H - 0.26, label, va="center", fontsize=ROUTE_PT)
        x += 0.45 + 0.105 * len(label) + 0.5

    col_a, col_b, col_c = (0.1, 3.5), (4.1, 4.0), (8.7, 3.8)  # (x, width) of the columns
    top, row1, row2 = (6.35, 1.2), (4.45, 1.5), (2.45, 1.6)  # (y, height) of the rows

    def mid(col, row):
        return col[0] + col[1] / 2, row[0] + row[1] / 2

    _node(ax, col_b[0], top[0], col_b[1], top[1], 'hf.register("course_kernels")',
          ["at import: one name, both functions"], C_COURSE)
    _node(ax, col_c[0], top[0], col_c[1], top[1], "refused",
          ["a mask with a hole (padding", "inside a sequence)"], C_REFUSED)
    _node(ax, col_a[0], row1[0], col_a[1], row1[1], "LlamaModel.forward",
          ["once per forward:", "create_causal_mask(...)"], C_HF)
    _node(ax, col_a[0], row2[0], col_a[1], row2[1], "LlamaAttention.forward",
          ["every layer: q, k, v, RoPE,", "cache.update(k, v), then",
           "attention_interface(...)"], C_HF)
    # transformers' two registries, looked up by the name
    st.box(ax, col_b[0], row2[0], col_b[1], row1[0] + row1[1] - row2[0], color=C_HF, lw=1.4)
    for row, table, kind in ((row1, "ALL_MASK_ATTENTION_FUNCTIONS", "AttentionMaskInterface"),
                             (row2, "ALL_ATTENTION_FUNCTIONS", "AttentionInterface")):
        bx, by = mid(col_b, row)
        ax.text(bx, by + 0.22, f"{table}[name]", ha="center", va="center", fontsize=ROUTE_PT,
                family=MONO, weight="bold")
        ax.text(bx, by - 0.22, f"(an {kind})", ha="center", va="center", fontsize=ROUTE_PT)
    _node(ax, col_c[0], row1[0], col_c[1], row1[1], "course_attention_mask",
          ["None, key counts L_b, or key", "ranges (q_lo, q_hi, k_lo, k_hi)"], C_COURSE)
    _node(ax, col_c[0], row2[0], col_c[1], row2[1], "course_attention_forward",
          ["query (B, H, N_q, D); key, value:", "the whole cache (B, H_kv, N_k, D);",
           "tests each call, in this order:"], C_COURSE)
    for row in (row1, row2):  # caller -> registry -> the course's function
        y = mid(col_a, row)[1]
        st.arrow(ax, (col_a[0] + col_a[1], y), (col_b[0], y), **dark)
        st.arrow(ax, (col_b[0] + col_b[1], y), (col_c[0], y), **dark)
    st.arrow(ax, (mid(col_b, top)[0], top[0]), (mid(col_b, top)[0], row1[0] + row1[1]),
             color="0.4", lw=1.4, ls="--")
    cx = mid(col_c, row1)[0]  # the course's column: the mask, then the attention function
    st.arrow(ax, (cx, row1[0] + row1[1]), (cx, top[0]), **red)
    st.arrow(ax, (cx, row1[0]), (cx, row2[0] + row2[1]), **dark)
    ax.text(cx + 0.1, (row1[0] + row2[0] + row2[1]) / 2, "attention_mask", va="center",
            fontsize=ROUTE_PT, family=MONO)

    # the four answers of the attention function, left to right in the order it tests them
    kernels = (
        ("1. refused", ["attention", "dropout > 0"], C_REFUSED, 1.95),
        ("2. flash_attn_varlen", ["the mask holds key ranges:", "a padded batch, its prefill",
                                  "and its decode steps", "(lesson 15)"], C_KERNEL, 3.1),
        ("3. flash_decode", ["N_q ≤ DECODE_MAX_QUERIES", "new tokens, N_k > N_q,",
                             "no gradient: decode", "(lesson 12)"], C_KERNEL, 3.25),
        ("4. flash_attn_v2", ["every other call: a prompt,", "more than DECODE_MAX_QUERIES",
                              "new tokens, or a gradient", "(lesson 08)"], C_KERNEL, 3.8),
    )
    y0, h = 0.1, 1.75
    bus = y0 + h + 0.25
    x, centers = 0.1, []
    for name, lines, color, w in kernels:
        _node(ax, x, y0, w, h, name, lines, color)
        centers.append(x + w / 2)
        st.arrow(ax, (centers[-1], bus), (centers[-1], y0 + h), **(red if color == C_REFUSED
                                                                     else dark))
        x += w + 0.1
    ax.plot([min(centers[0], cx), max(centers[-1], cx)], [bus, bus], color="0.25", lw=1.6)
    ax.plot([cx, cx], [row2[0], bus], color="0.25", lw=1.6)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure (or None
#: without the stored measurement).
FIGURES = {"14_llama_routes": llama_routes_figure,
           "14_llama_result": llama_result_figure,
           "slides_capstone_result": slides_capstone_result_figure}
