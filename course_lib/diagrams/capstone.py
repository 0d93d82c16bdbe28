"""The capstone's measured result: a LLaMA with the course's kernels against the same LLaMA with
PyTorch's SDPA, prefill and decode, from the stored run.

Introduced in notebooks/14_llama_capstone.ipynb (section 6). Drawn from
course_lib/data/llama.json (written by the notebook's GPU cells, ``course_lib.hf.benchmark``):
per prompt length, the prefill time (one forward over the prompt) and the decode time per
generated token, with ``attn_implementation="course_kernels"`` and ``"sdpa"`` on one model with
the same weights. Both sides use one harness (``HARNESS``: ``hf.time_prefills_in_turns``
and ``hf.time_decodes_in_turns``), named in every title. ``slides_capstone_result`` is the same
picture drawn for a slide (``course_lib.diagrams.slides_style``).
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


#: Figures of this module: image name -> function returning a matplotlib Figure (or None
#: without the stored measurement).
FIGURES = {"14_llama_result": llama_result_figure,
           "slides_capstone_result": slides_capstone_result_figure}
