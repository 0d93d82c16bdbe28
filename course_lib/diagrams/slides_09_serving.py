"""Slide figures of deck 09 (serving): continuous against static batching, one packed step,
shared prefix blocks, cascade attention and its measured speed, a token tree and its mask.

Drawn for slides/09_serving.md at slide size (``slides_style``) from the same code and data as
notebooks/16_serving.ipynb: ``course_lib.serving.Scheduler`` (the timeline of
``diagrams.serving.timelines``, one step's packed chunks, the prefix cache's blocks after two
requests with one system prompt), ``course_lib.masks.visible`` (what each chunk's queries see),
``course_lib.serving.tree_mask`` on ``diagrams.serving.example_tree``, the shapes and the stored
H200 run of course_lib/data/cascade.json (``python -m course_lib.bench cascade``).
"""
from __future__ import annotations

import numpy as np

from course_lib.diagrams.slides_style import (
    C_NEW,
    C_OLD,
    C_SUM,
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

C_PREFILL, C_DECODE = C_OLD, C_NEW  # as the notebook's timeline (``diagrams.serving``)
C_SHARED, C_A, C_B, C_FREE = C_SUM, C_OLD, C_NEW, "0.88"


# ---------------------------------------------------------------------------------------------
# continuous against static batching
# ---------------------------------------------------------------------------------------------

def batching():
    """The notebook's timeline at slide size: one row per request, one column per step, a
    prefill chunk (its tokens written in it) or one decode token, both policies on
    ``diagrams.serving.WORKLOAD`` (``Scheduler.history``)."""
    from matplotlib.patches import Patch, Rectangle

    from course_lib.diagrams.serving import MAX_RUNNING, TOKEN_BUDGET, WORKLOAD, timelines

    data = timelines()
    longest = max(steps for steps, _ in data.values())
    fig = slide_figure(1100, 440)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (name, (steps, rows)) in zip(axes, data.items()):
        for r, (rid, cells) in enumerate(rows.items()):
            for step, kind, n in cells:
                color = C_PREFILL if kind == "prefill" else C_DECODE
                ax.add_patch(Rectangle((step, r), 1, 0.84, color=color, lw=0))
                if kind == "prefill":
                    ax.text(step + 0.5, r + 0.42, str(n), ha="center", va="center",
                            color="white", fontsize=MIN_PT, weight="bold")
        ax.set_xlim(0, longest)
        ax.set_ylim(len(rows), -0.1)
        ax.set_yticks([r + 0.42 for r in range(len(rows))],
                      [f"{p} + {n}" for p, n in WORKLOAD])
        ax.set_title(f"{name} batching: {steps} steps", loc="left", fontsize=TITLE_PT)
        style_axes(ax, grid=False)
    axes[-1].set_xlabel(f"step (one forward pass; at most {MAX_RUNNING} requests and "
                        f"{TOKEN_BUDGET} tokens a step)")
    fig.supylabel("request: prompt + new tokens", fontsize=LABEL_PT)
    fig.legend(handles=[Patch(color=C_PREFILL, label="prefill chunk (its tokens)"),
                        Patch(color=C_DECODE, label="decode: one token")],
               loc="outside upper right", ncols=2, fontsize=MIN_PT, frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# one step: the packed chunks and what their queries see
# ---------------------------------------------------------------------------------------------

#: The step drawn: the first one of the timeline's continuous run with a decode and prefills.
PACKED_STEP = 1


def packed_step_batch(step: int = PACKED_STEP):
    """The ``Batch`` of step ``step`` when ``diagrams.serving.WORKLOAD`` is served with
    continuous batching (the timeline's run)."""
    from course_lib.diagrams.serving import advance, workload_scheduler

    s = workload_scheduler()
    advance(s, step)
    return s.step()


def packed_step():
    """One step's mask as ``flash_attn_varlen`` applies it: the packed queries (rows, cut by
    cu_seqlens_q) against each chunk's keys (its request's cache, this step's rows included),
    causal and bottom-right aligned within each chunk (``masks.visible``); nothing across
    chunks."""
    from matplotlib.colors import ListedColormap

    from course_lib import masks

    batch = packed_step_batch()
    cu_q = batch.cu_seqlens_q
    cu_k = [0]
    for n in batch.seqlens_k:
        cu_k.append(cu_k[-1] + n)
    grid = np.zeros((cu_q[-1], cu_k[-1]))
    causal = masks.normalize_window(masks.FULL, causal=True)
    for b, chunk in enumerate(batch.chunks):
        seen = masks.visible(chunk.num_tokens, chunk.num_keys, causal).numpy()
        new = np.arange(chunk.num_keys) >= chunk.start  # this step's keys
        grid[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = np.where(seen, 1 + new, 0)
    fig = slide_figure(860, 345)
    ax = fig.subplots()
    cmap = ListedColormap(["white", "#aed3f0", C_PREFILL])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest",
              extent=(0, cu_k[-1], cu_q[-1], 0))
    for x in cu_k[1:-1]:
        ax.axvline(x, color="k", lw=1.5)
    for y in cu_q[1:-1]:
        ax.axhline(y, color="k", lw=1.5)
    for b, chunk in enumerate(batch.chunks):
        ax.add_patch(_outline(cu_k[b], cu_q[b], chunk.num_keys, chunk.num_tokens))
    ax.set_yticks([(cu_q[b] + cu_q[b + 1]) / 2 for b in range(len(batch))],
                  [f"req {c.request_id}: {'decode' if c.is_decode else 'prefill'} "
                   f"{c.num_tokens}" for c in batch.chunks])
    ax.set_xticks([(cu_k[b] + cu_k[b + 1]) / 2 for b in range(len(batch))],
                  [f"{c.num_keys} keys" for c in batch.chunks])
    ax.tick_params(length=0)
    ax.set_xlabel("keys of each request (from its block table)")
    ax.set_title(f"step {batch.step}: cu_seqlens_q = {cu_q}",
                 loc="left", fontsize=TITLE_PT)
    style_axes(ax, grid=False)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color="#aed3f0", label="cached key,\nseen"),
                        Patch(color=C_PREFILL, label="this step's\nkey, seen"),
                        Patch(facecolor="white", edgecolor="0.5", label="not seen")],
               loc="outside right center", fontsize=MIN_PT, frameon=False)
    return fig


def _outline(x, y, w, h):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor="k", lw=2.5)


# ---------------------------------------------------------------------------------------------
# prefix caching: two requests, one system prompt
# ---------------------------------------------------------------------------------------------

SYSTEM = list(range(1, 9))      # a system prompt of two full blocks of 4
OWN = {"A": [21, 22, 23, 24, 25, 26], "B": [31, 32, 33, 34, 35]}
POOL = 8


def prefix_state():
    """The scheduler after request A (system prompt + 6 tokens) has run its prefill and B
    (system prompt + 5 tokens) has arrived one step later: (scheduler, {"A": request, "B":
    request}). B's first two blocks are A's, found by their names."""
    from course_lib.diagrams.serving import advance
    from course_lib.serving import Scheduler

    s = Scheduler(num_blocks=POOL, block_size=4, max_tokens_per_step=16, max_running=4)
    reqs = {name: s.add_request(SYSTEM + own, 4, arrival_step=i, request_id=name)
            for i, (name, own) in enumerate(OWN.items())}
    advance(s, 2)
    return s, reqs


def prefix_blocks():
    """Block tables of A and B over the pool: each logical block (its tokens) points at its
    physical block; the pool shows every block's reference count and the first hex digits of
    its name (``block_hash``), if it has one."""
    s, reqs = prefix_state()
    names = {}
    for r in reqs.values():
        for j, h in enumerate(r.block_hashes):
            names[r.block_table[j]] = h.hex()[:4]
    owners = {}
    for name, r in reqs.items():
        for b in r.block_table:
            owners.setdefault(b, set()).add(name)
    fig = slide_figure(1000, 300)
    ax = fig.subplots()
    blank(ax, (-1.75, POOL + 0.05), (-0.05, 3.45))
    w, h, bs = 0.84, 0.62, s.block_size
    y_pool, h_pool = 1.18, 1.08
    rows = {"A": 2.8, "B": 0.0}  # A's table above the pool, B's below
    # the pool: each block's id, reference count and name
    ax.text(-0.12, y_pool + h_pool / 2, "block\nrefs\nname", ha="right", va="center",
            fontsize=MIN_PT, linespacing=1.3)
    for b in range(POOL):
        who = owners.get(b, set())
        color = C_SHARED if len(who) == 2 else C_A if who == {"A"} else C_B if who else C_FREE
        text = f"{b}\n{s.allocator.refcount(b)}\n" + (f"#{names[b]}" if b in names else "–")
        box(ax, b + 0.08, y_pool, w, h_pool, color=color)
        ax.text(b + 0.5, y_pool + h_pool / 2, text, ha="center", va="center", fontsize=MIN_PT,
                linespacing=1.3, color="white" if who else "k", weight="bold")
    # the block tables: each logical block (its tokens) points at its physical block
    for name, r in reqs.items():
        y = rows[name]
        ax.text(-0.12, y + h / 2, f"{name}'s table", ha="right", va="center",
                fontsize=LABEL_PT, weight="bold")
        tokens = r.tokens[:r.num_computed]
        for j, b in enumerate(r.block_table):
            part = tokens[j * bs:(j + 1) * bs]
            shared = len(owners[b]) == 2
            label = "system" if shared else f"own {len(part)}"
            x = j * 1.0 + 0.08
            box(ax, x, y, w, h, label, color="white", edge=C_SHARED if shared else
                (C_A if name == "A" else C_B), lw=3, fontsize=MIN_PT)
            if name == "A":
                arrow(ax, (x + w / 2, y), (b + 0.5, y_pool + h_pool + 0.02), color="0.4", lw=2)
            else:
                arrow(ax, (x + w / 2, y + h), (b + 0.5, y_pool - 0.02), color="0.4", lw=2)
    return fig


# ---------------------------------------------------------------------------------------------
# cascade attention
# ---------------------------------------------------------------------------------------------

def _cascade_rows():
    from course_lib.bench.common import load_result

    return load_result("cascade")  # None where it was never measured


def kv_rows_read(B: int, P: int, S: int) -> tuple[int, int]:
    """K/V rows read per K/V head in one decode step: each request's whole context
    (``paged_decode`` over P + S keys each) against cascade (the prefix once, then each
    suffix)."""
    return B * (P + S), P + B * S


def cascade():
    """Cascade attention on the measured shape with most requests and the 4k prefix: left,
    each request reads its whole context, the prefix B times; right, one dense product of
    every request's queries against the prefix, the suffixes by ``paged_decode``, a merge."""
    result = _cascade_rows()
    if result is None:
        return None
    row = max((r for r in result["rows"] if r["P"] == 4096), key=lambda r: r["B"])
    B, P, S, G = row["B"], row["P"], row["S"], row["H"] // row["H_kv"]
    whole, casc = kv_rows_read(B, P, S)
    fig = slide_figure(1160, 330)
    ax_w, ax_c = fig.subplots(1, 2)
    shown = 4  # requests drawn; the counts are the measured shape's
    unit = 3.0 / (P + S)  # drawing width of one key
    for ax, title in ((ax_w, f"whole context: {whole:,} K/V rows per head"),
                      (ax_c, f"cascade: {casc:,} K/V rows per head")):
        blank(ax, (-0.8, 5.0), (-0.75, shown + 0.75))
        ax.set_title(title, fontsize=TITLE_PT)
    ys = [shown - 0.6 - i for i in range(shown)]
    x_s = P * unit + 0.06  # where a suffix starts
    for i, y in enumerate(ys):  # left: every request reads the prefix again
        box(ax_w, 0, y, P * unit, 0.6, "prefix" if i == 0 else "", color=C_SHARED,
            text_color="white", fontsize=MIN_PT)
        box(ax_w, x_s, y, S * unit, 0.6, color=C_OLD)
        ax_w.text(-0.1, y + 0.3, f"req {i}", ha="right", va="center", fontsize=MIN_PT)
    ax_w.text(x_s + S * unit + 0.12, ys[0] + 0.3, "own", ha="left", va="center",
              fontsize=MIN_PT)
    ax_w.text(1.5, -0.45, f"… {B} requests: the prefix read {B} times", ha="center",
              va="center", fontsize=MIN_PT)
    # right: the prefix once, as one dense product of all the rows; then the merge
    box(ax_c, 0, ys[-1], P * unit, ys[0] + 0.6 - ys[-1],
        f"one dense product:\nflash_attn_v2,\n{B} × {G} query rows\nper K/V head", color=C_SHARED,
        text_color="white", fontsize=MIN_PT)
    for y in ys:
        box(ax_c, x_s, y, S * unit, 0.6, color=C_OLD)
    ax_c.text(x_s + S * unit / 2, -0.45, "own: paged_decode", ha="center", va="center",
              fontsize=MIN_PT)
    arrow(ax_c, (x_s + S * unit + 0.12, shown / 2), (3.85, shown / 2), lw=2.5)
    ax_c.text(4.4, shown / 2, "merge\n(o, lse)", ha="center", va="center", fontsize=LABEL_PT,
              weight="bold")
    return fig


def cascade_speed():
    """The stored H200 run (course_lib/data/cascade.json): one decode step's time, replayed as
    a CUDA graph, whole-context ``paged_decode`` against ``cascade_decode``, per shape."""
    result = _cascade_rows()
    if result is None:
        return None
    rows = sorted(result["rows"], key=lambda r: (r["B"], r["P"]))
    fig = slide_figure(1100, 300)
    ax = fig.subplots()
    x = np.arange(len(rows))
    whole = [1e3 * r["ms"]["whole context (graph)"] for r in rows]
    casc = [1e3 * r["ms"]["cascade (graph)"] for r in rows]
    ax.bar(x - 0.2, whole, 0.4, color=GREY, label="each request's whole context (paged_decode)")
    ax.bar(x + 0.2, casc, 0.4, color=C_SHARED, label="cascade_decode")
    for xi, r, c in zip(x, rows, casc):
        ax.text(xi + 0.2, c + 10, f"{c:.0f}", ha="center", va="bottom", fontsize=MIN_PT)
        ax.text(xi + 0.2, c + 62, f"{r['speedup_graph']:.2f}×", ha="center", va="bottom",
                fontsize=LABEL_PT, weight="bold", color=C_SHARED)
    for xi, v in zip(x, whole):
        ax.text(xi - 0.2, v + 10, f"{v:.0f}", ha="center", va="bottom", fontsize=MIN_PT)
    r0 = rows[0]
    ax.set_title(f"one decode step: H {r0['H']}, H_kv {r0['H_kv']}, D {r0['D']}, "
                 f"{r0['S']} own tokens per request", loc="left", fontsize=TITLE_PT)
    ax.set_xticks(x, [f"B {r['B']}, prefix {r['P'] // 1024}k" for r in rows])
    ax.set(ylabel="µs per step (CUDA graph)", ylim=(0, max(whole) * 1.18))
    style_axes(ax)
    ax.grid(False, axis="x")
    legend(ax, loc="upper left")
    return fig


# ---------------------------------------------------------------------------------------------
# the token tree
# ---------------------------------------------------------------------------------------------

def token_tree():
    """The notebook's token tree at slide size: the tree (node 0 the last accepted token,
    nodes placed at their depth) beside ``tree_mask``, row i True where node i sees node j."""
    from course_lib.diagrams.serving import C_TREE, example_tree, tree_layout
    from course_lib.serving import tree_mask

    tree = example_tree()
    mask = tree_mask(tree).numpy()
    n = len(tree)
    fig = slide_figure(900, 260)
    ax_tree, ax_mask = fig.subplots(1, 2, width_ratios=[1.35, 1])
    pos = tree_layout(tree)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            (x0, y0), (x1, y1) = pos[parent], pos[i]
            ax_tree.plot([x0, x1], [y0, y1], color="0.5", lw=2, zorder=1)
    for i, (x, y) in pos.items():
        ax_tree.scatter([x], [y], s=1100, color=C_TREE if i else "0.75", zorder=2)
        ax_tree.text(x, y, str(i), ha="center", va="center", fontsize=LABEL_PT, zorder=3,
                     weight="bold")
    depths = sorted(set(tree.depths))
    ax_tree.set_xticks(depths, [f"L + {d}" for d in depths])
    ax_tree.set_xlabel("position (L tokens before node 0)")
    ax_tree.set_yticks([])
    ax_tree.set_xlim(-0.4, max(depths) + 0.4)
    ax_tree.set_ylim(min(y for _, y in pos.values()) - 0.6, -0.4)  # the lowest leaf
    ax_tree.set_title("siblings: candidates for one position", loc="left", fontsize=TITLE_PT)
    style_axes(ax_tree, grid=False)
    ax_tree.spines["left"].set_visible(False)
    ax_mask.imshow(mask, cmap="Greens", vmin=0, vmax=1.6)
    ax_mask.set_xticks(range(n), [str(j) for j in range(n)])
    ax_mask.set_yticks(range(n), [str(i) for i in range(n)])
    ax_mask.set_xlabel("key: node j")
    ax_mask.set_ylabel("query: node i")
    ax_mask.set_title("tree_mask: i sees j", loc="left", fontsize=TITLE_PT)
    style_axes(ax_mask, grid=False)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {
    "slides_09_batching": batching,
    "slides_09_packed_step": packed_step,
    "slides_09_prefix_blocks": prefix_blocks,
    "slides_09_cascade": cascade,
    "slides_09_cascade_speed": cascade_speed,
    "slides_09_token_tree": token_tree,
}
