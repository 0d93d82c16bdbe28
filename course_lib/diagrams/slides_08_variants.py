"""Slide figures of deck 08 (attention variants): the window rule, block maps as a
build, the score changes, and the measured speed, forward and backward.

Drawn for slides/08_variants.md at slide size (``slides_style``) from the same code and data as
notebooks/15_attention_variants.ipynb: ``course_lib.masks`` (which keys a query sees:
``visible``, ``block_kind``, ``alibi_bias``), ``iomodel.variants`` (``block_map`` and the counts
of ``variant_io``) and the stored H100 runs course_lib/data/variants_fwd.json and
variants_bwd.json. The four block maps (causal, sliding window, causal + window, packed
sequences) share one size and one layout, so the deck steps through them as a build, one per
slide.
"""
from __future__ import annotations

import numpy as np

from course_lib.diagrams.slides_style import (
    C_MAX,
    C_NEW,
    C_OLD,
    C_SUM,
    LABEL_PT,
    MIN_PT,
    TITLE_PT,
    legend,
    slide_figure,
    style_axes,
)

#: Tile colours by kind, as deck 05's causal map (``analysis.flash_v2.KIND_COLORS``).
KIND_COLORS = {"skipped": "#e6e6e6", "unmasked": "#4c9be8", "masked": "#f5a142"}
KINDS = ("unmasked", "masked", "skipped")

#: The build's problem: one head, N_q = N_k = 1024, the kernel's 128 × 64 tiles.
N_MAP, BLOCK_M, BLOCK_N = 1024, 128, 64
WINDOW_LEFT, WINDOW_RIGHT = 256, 128
PACKED = (300, 470, 254)   # packed sequence lengths (sum 1024), causal within each


def _fmt_window(window) -> str:
    return "(" + ", ".join("−1" if w < 0 else str(w) for w in window) + ")"


def window_rule(n_q: int = 5, n_k: int = 9):
    """Which keys each query sees, pair by pair, for a short query block against a longer key
    sequence (N_q < N_k): causal, and a causal sliding window. Bottom-right aligned: query i
    sits at key position p = i + N_k − N_q, outlined in black."""
    from matplotlib.colors import ListedColormap

    from course_lib import masks

    cases = (("causal: window (−1, 0)", masks.normalize_window(masks.FULL, causal=True)),
             ("sliding window (3, 0)", (3, 0)))
    fig = slide_figure(1160, 330)
    axes = fig.subplots(1, 2)
    cmap = ListedColormap([KIND_COLORS["skipped"], C_OLD])
    for ax, (title, window) in zip(axes, cases):
        vis = masks.visible(n_q, n_k, window).numpy().astype(int)
        ax.imshow(vis, cmap=cmap, vmin=0, vmax=1, aspect="equal", interpolation="nearest",
                  extent=(-0.5, n_k - 0.5, n_q - 0.5, -0.5))
        for i in range(n_q):  # the query's own key position p
            p = i + n_k - n_q
            ax.add_patch(_rect(p - 0.5, i - 0.5, 1, 1, fill=False, edge="k", lw=3.5))
            ax.patches[-1].set_zorder(5)
        ax.set_xticks(np.arange(n_k + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(n_q + 1) - 0.5, minor=True)
        ax.tick_params(which="minor", length=0)
        ax.set_xticks(range(n_k))
        ax.set_yticks(range(n_q), [f"i={i}, p={i + n_k - n_q}" for i in range(n_q)])
        ax.set_xlabel(f"key j (N_k = {n_k}; query rows: N_q = {n_q})", fontsize=LABEL_PT)
        ax.set_title(title, fontsize=TITLE_PT)
        style_axes(ax, grid=False)
        ax.grid(which="minor", color="white", lw=2)
    return fig


def _rect(x, y, w, h, color="none", edge="white", lw=1.5, fill=True):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color if fill else "none", edgecolor=edge, lw=lw)


def _segments(variant: str):
    """(q0, k0, n_q, n_k) of each sequence, and the normalised window, of a build step."""
    from course_lib import masks

    if variant == "varlen":
        starts = np.concatenate([[0], np.cumsum(PACKED)[:-1]]).tolist()
        return [(s, s, n, n) for s, n in zip(starts, PACKED)], (-1, 0)
    window = {"causal": masks.normalize_window(masks.FULL, causal=True),
              "window": (WINDOW_LEFT, WINDOW_RIGHT),
              "causal_window": masks.normalize_window((WINDOW_LEFT, -1), causal=True)}[variant]
    return [(0, 0, N_MAP, N_MAP)], window


def block_map_step(variant: str):
    """One step of the build: the (query, key) plane of N_q = N_k = 1024 cut into the kernel's
    128 × 64 tiles, each coloured by ``masks.block_kind`` (through ``iomodel.variants.
    block_map``), the edges of the visible band in black, and the counts of ``variant_io``
    beside it. ``variant``: "causal", "window" (256 left, 128 right), "causal_window" (256, 0)
    or "varlen" (three packed sequences, causal within each; each is tiled on its own)."""
    from matplotlib.patches import Patch

    from course_lib.iomodel.variants import block_map, variant_io

    segments, window = _segments(variant)
    # Fixed positions (no constrained layout) and a frame that pins the saved area: every step
    # of the build is the same size, its map at the same place.
    fig = slide_figure(1160, 440, layout=None)
    fig.patches.append(_rect(0, 0, 1, 1, edge="none", fill=False))
    fig.patches[-1].set_transform(fig.transFigure)
    ax = fig.add_axes((0.085, 0.16, 0.60, 0.81))
    counts = {k: 0 for k in KINDS}
    seen = computed = 0
    for q0, k0, nq, nk in segments:
        kinds = block_map(nq, nk, BLOCK_M, BLOCK_N, window)
        for i, row in enumerate(kinds):
            r0, r1 = q0 + i * BLOCK_M, q0 + min((i + 1) * BLOCK_M, nq)
            for j, kind in enumerate(row):
                c0, c1 = k0 + j * BLOCK_N, k0 + min((j + 1) * BLOCK_N, nk)
                ax.add_patch(_rect(c0 / BLOCK_N, r0 / BLOCK_M, (c1 - c0) / BLOCK_N,
                                   (r1 - r0) / BLOCK_M, KIND_COLORS[kind]))
        io = variant_io(nq, nk, 128, BLOCK_M, BLOCK_N, window)
        for k in KINDS:
            counts[k] += io["blocks"][k]
        seen += io["visible_pairs"]
        computed += io["computed_pairs"]
        _band_edges(ax, q0, k0, nq, nk, window)
        if len(segments) > 1:
            ax.add_patch(_rect(k0 / BLOCK_N, q0 / BLOCK_M, nk / BLOCK_N, nq / BLOCK_M,
                               edge="k", lw=2, fill=False))
    ax.set_xlim(0, N_MAP / BLOCK_N)
    ax.set_ylim(N_MAP / BLOCK_M, 0)
    ax.set_aspect("equal")
    ax.set_xticks(range(0, N_MAP // BLOCK_N + 1, 4), [str(x * BLOCK_N) for x in
                                                      range(0, N_MAP // BLOCK_N + 1, 4)])
    ax.set_yticks(range(0, N_MAP // BLOCK_M + 1, 2), [str(y * BLOCK_M) for y in
                                                      range(0, N_MAP // BLOCK_M + 1, 2)])
    ax.set_xlabel(f"key j (tiles of {BLOCK_N})", fontsize=LABEL_PT)
    ax.set_ylabel(f"query i (tiles of {BLOCK_M})", fontsize=LABEL_PT)
    style_axes(ax, grid=False)
    title = {"causal": "causal, window (−1, 0)",
             "window": f"sliding window {_fmt_window(window)}",
             "causal_window": f"causal + window {_fmt_window(window)}",
             "varlen": "packed " + " + ".join(str(n) for n in PACKED)}[variant]
    handles = [Patch(color=KIND_COLORS[k], label=f"{k}: {counts[k]}") for k in KINDS]
    if len(segments) > 1:
        handles.append(Patch(facecolor="white", edgecolor="0.6",
                             label="another sequence:\nno program visits it"))
    leg = ax.legend(handles=handles, fontsize=LABEL_PT, loc="upper left",
                    bbox_to_anchor=(1.02, 1.02), frameon=False, title=title,
                    title_fontsize=LABEL_PT)
    leg._legend_box.align = "left"
    ax.text(1.04, 0.02, f"pairs seen      {seen:,}\npairs computed {computed:,}\n"
            f"({computed / seen:.2f}× the pairs seen)", transform=ax.transAxes,
            fontsize=LABEL_PT, va="bottom", ha="left", family="DejaVu Sans Mono")
    return fig


def _band_edges(ax, q0, k0, nq, nk, window) -> None:
    """The first and one-past-the-last key each row sees (``masks.key_bounds``), as
    staircases in the tile coordinates of the map."""
    import torch

    from course_lib import masks

    rows = torch.arange(nq)
    lo, hi = masks.key_bounds(rows, nq, nk, window)
    ys = (q0 + np.stack([rows.numpy(), rows.numpy() + 1], 1).ravel()) / BLOCK_M
    for edge, bounded in ((lo, window[0] >= 0), (hi, window[1] >= 0)):
        if bounded:
            x = (k0 + np.repeat(edge.numpy(), 2)) / BLOCK_N
            ax.plot(x, ys, color="k", lw=2)


def score_changes(softcap: float = 50.0, heads: int = 8):
    """Left: Gemma 2's attention softcap s ↦ c·tanh(s/c) (c = 50) and its derivative
    1 − tanh²(s/c), the factor the backward multiplies dS by. Right: ALiBi's bias −m·|p − j|
    for the slopes m = 2^(−8h/H) of H = 8 heads (Press et al.), from ``masks.alibi_bias``."""
    import torch

    from course_lib import masks

    fig = slide_figure(1160, 380)
    ax1, ax2 = fig.subplots(1, 2)
    s = np.linspace(-150, 150, 601)
    ax1.plot(s, s, color="0.6", ls="--", lw=2.5, label="s (no cap)")
    ax1.plot(s, softcap * np.tanh(s / softcap), color=C_MAX, lw=3.5,
             label=f"{softcap:.0f}·tanh(s/{softcap:.0f})")
    ax1.set(xlabel="raw score s", ylabel="score after the cap", ylim=(-110, 110),
            title=f"softcap c = {softcap:.0f}")
    style_axes(ax1)
    d = ax1.twinx()
    d.plot(s, 1 - np.tanh(s / softcap) ** 2, color=C_SUM, lw=3, label="1 − tanh²(s/c)")
    d.set_ylim(0, 2.2)
    d.set_yticks([0, 0.5, 1])
    d.tick_params(labelsize=MIN_PT, colors=C_SUM)
    d.spines["top"].set_visible(False)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = d.get_legend_handles_labels()
    legend(ax1, handles=h1 + h2, labels=l1 + l2, loc="upper left")

    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)],
                          dtype=torch.float64)
    n = 64
    bias = masks.alibi_bias(slopes, 1, n)[0, :, 0, :].numpy()  # (H, n): the last query, p = n − 1
    dist = (n - 1) - np.arange(n)
    colors = (C_MAX, C_NEW, C_SUM, C_OLD)
    for h in range(0, heads, 2):
        ax2.plot(dist, bias[h], color=colors[h // 2], lw=3,
                 label=f"head {h + 1}: m = 1/{2 ** (8 * (h + 1) // heads)}")
    ax2.set(xlabel="distance p − j", ylabel="bias added to the score",
            title=f"ALiBi, H = {heads}: slopes 2^(−8h/H)", xlim=(0, n - 1))
    style_axes(ax2)
    legend(ax2, loc="lower left")
    return fig


_SPEED = (("causal", "causal"),
          ("window 1024", "window 1024"),
          ("causal + softcap", "causal softcap"),
          ("causal + ALiBi", "causal alibi"),
          ("causal + sinks", "causal sinks"))
#: The course's kernels without variants: the forward ``flash_attn_v2`` runs on an H100 (the
#: Hopper kernel, ``flash_v2_hopper``), and lesson 10's backward (``flash_bwd``), the only one.
_DENSE = {"forward": "flash_attn_v2 causal (auto)", "backward": "flash_attn_v2 causal (portable)"}
#: Our variants' bars: the TMA forward (``flash_variants_hopper``, what ``flash_attn_v2`` runs on
#: an H100 at D 128) and the one backward (``flash_variants_bwd``).
_OURS = {"forward": "variants hopper", "backward": "variants"}


def _speed_panel(ax, t: dict, title: str, labels: bool, direction: str = "forward") -> None:
    """One direction's bars: ours and FlexAttention per variant (FlexAttention has no sinks),
    then the dense causal kernel after a gap. ``t``: provider -> TFLOP/s on the visited area."""
    rows = [(label, t[f"{_OURS[direction]} {key}"], t.get(f"flex {key}"), C_MAX)
            for label, key in _SPEED]
    rows.append(("dense causal", t[_DENSE[direction]], None, "0.55"))
    y = np.arange(len(rows), dtype=float)
    y[-1] += 0.4  # a gap before the dense kernel
    for yi, (_, ours, flex, color) in zip(y, rows):
        off = -0.2 if flex else 0.0
        ax.barh(yi + off, ours, 0.4, color=color)
        ax.text(ours + 8, yi + off, f"{ours:.0f}", va="center", fontsize=LABEL_PT, color=color)
        if flex:
            ax.barh(yi + 0.2, flex, 0.4, color=C_OLD)
            ax.text(flex + 8, yi + 0.2, f"{flex:.0f}", va="center", fontsize=LABEL_PT,
                    color=C_OLD)
    ax.set_yticks(y, [label for label, *_ in rows])
    ax.tick_params(axis="y", labelsize=LABEL_PT, length=0, labelleft=labels)
    ax.set(xlim=(0, 620), ylim=(y[-1] + 0.6, -0.6), xticks=range(0, 601, 100))
    ax.set_xlabel("TFLOP/s on the visited area", fontsize=LABEL_PT)
    ax.set_title(title, fontsize=TITLE_PT)
    style_axes(ax)
    ax.grid(False, axis="y")


def speed():
    """Measured TFLOP/s on the visited area, forward (course_lib/data/variants_fwd.json) and
    backward (variants_bwd.json), one panel each: the runs' GPU, B 2, H 16, N 16k, D 128, bf16;
    the backward timed alone (autograd.grad of a forward made once, every provider alike);
    do_bench median of rounds in turns. The variants' kernels (the TMA forward, the one
    backward) against FlexAttention, and the course's dense causal kernels (the Hopper forward,
    lesson 10's backward) below them."""
    from matplotlib.patches import Patch

    from course_lib.bench.common import load_result

    fwd, bwd = load_result("variants_fwd"), load_result("variants_bwd")
    if fwd is None or bwd is None:
        return None
    fig = slide_figure(1160, 400)
    axes = fig.subplots(1, 2)
    for i, (ax, result, title) in enumerate(zip(
            axes, (fwd, bwd), ("forward (TMA kernel)",
                               "backward (2.5× the forward's FLOPs)"))):
        _speed_panel(ax, {r["provider"]: r["tflops_visited"] for r in result["rows"]}, title,
                     labels=i == 0, direction=("forward", "backward")[i])
    fig.legend(handles=[Patch(color=C_MAX, label="course variants kernels"),
                        Patch(color=C_OLD, label="FlexAttention (compiled)"),
                        Patch(color="0.55", label="course dense kernels")],
               loc="outside upper center", ncols=3, fontsize=LABEL_PT, frameon=False)
    return fig


FIGURES = {
    "slides_08_window_rule": window_rule,
    "slides_08_map_causal": lambda: block_map_step("causal"),
    "slides_08_map_window": lambda: block_map_step("window"),
    "slides_08_map_causal_window": lambda: block_map_step("causal_window"),
    "slides_08_map_varlen": lambda: block_map_step("varlen"),
    "slides_08_score_changes": score_changes,
    "slides_08_speed": speed,
}
