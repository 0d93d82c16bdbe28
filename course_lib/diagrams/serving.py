"""Serving in pictures: a batch's timeline under continuous and static batching, and a token
tree with its attention mask.

Introduced in notebooks/16_serving.ipynb. Both pictures are drawn from the course's code, so
they cannot drift from it: the timeline from ``course_lib.serving.Scheduler.history`` after
serving one small workload both ways (a stand-in model: the scheduler needs only the number of
tokens each request asks for), the tree from ``course_lib.serving.TokenTree`` and
``tree_mask``. References: Yu et al., "Orca: A Distributed Serving System for
Transformer-Based Generative Models", OSDI 2022, section 3.1 (iteration-level scheduling),
https://www.usenix.org/conference/osdi22/presentation/yu; Miao et al., "SpecInfer", ASPLOS
2024, section 4.2 (tree attention), https://arxiv.org/abs/2305.09781.
"""
from __future__ import annotations

#: The workload of the timeline: (prompt tokens, new tokens) per request, all arrived at once.
WORKLOAD = ((12, 3), (6, 14), (9, 5), (4, 9), (10, 4), (5, 11), (8, 3), (7, 6))
MAX_RUNNING = 4
TOKEN_BUDGET = 16
C_PREFILL = "#2e86c1"
C_DECODE = "#e67e22"
C_TREE = "#27ae60"


def timelines() -> dict:
    """{"continuous" | "static": (steps, rows)}: each policy's number of steps and, per
    request, the (step, "prefill" | "decode", tokens) it ran, from ``Scheduler.history``."""
    from course_lib.serving import Scheduler

    out = {}
    for name in ("continuous", "static"):
        s = Scheduler(num_blocks=64, block_size=4, max_tokens_per_step=TOKEN_BUDGET,
                      max_running=MAX_RUNNING, static=name == "static")
        for i, (prompt, new) in enumerate(WORKLOAD):
            s.add_request([i + 1] * prompt, new)
        while s.has_unfinished():
            batch = s.step()
            s.update(batch, [0 for c in batch.chunks if c.samples])  # tokens: any will do
        rows = {rid: [] for rid in s.requests}
        for h in s.history:
            for rid, kind, n in h.chunks:
                rows[rid].append((h.step, kind, n))
        out[name] = (len(s.history), rows)
    return out


def timeline_figure():
    """Notebook figure: one row per request, one column per step; a prefill chunk (its tokens
    written in it) or a decode token, for both policies on the same workload."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    data = timelines()
    longest = max(steps for steps, _ in data.values())
    fig = Figure(figsize=(13, 6.4), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (name, (steps, rows)) in zip(axes, data.items()):
        for r, (rid, cells) in enumerate(rows.items()):
            for step, kind, n in cells:
                color = C_PREFILL if kind == "prefill" else C_DECODE
                ax.add_patch(Rectangle((step, r), 1, 0.8, color=color, lw=0))
                if kind == "prefill":
                    ax.text(step + 0.5, r + 0.4, str(n), ha="center", va="center",
                            color="white", fontsize=9)
        ax.set_xlim(0, longest)
        ax.set_ylim(len(rows), -0.2)
        ax.set_yticks([r + 0.4 for r in range(len(rows))],
                      [f"req {rid}: {p} + {n}" for rid, (p, n) in zip(rows, WORKLOAD)],
                      fontsize=10)
        ax.set_title(f"{name} batching: {steps} steps (at most {MAX_RUNNING} requests and "
                     f"{TOKEN_BUDGET} tokens a step)", loc="left", fontsize=12)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("step (one forward pass of the model)", fontsize=11)
    fig.legend(handles=[Patch(color=C_PREFILL, label="prefill chunk (its tokens)"),
                        Patch(color=C_DECODE, label="decode: one token")],
               loc="outside upper right", ncols=2, fontsize=10, frameon=False)
    return fig


def example_tree():
    """The tree drawn: a root (the last accepted token) with two candidates, each with its
    continuations, six drafted nodes in all."""
    from course_lib.serving import TokenTree

    return TokenTree(tokens=[11, 21, 22, 31, 32, 33, 41], parents=[-1, 0, 0, 1, 1, 2, 3])


def token_tree_figure():
    """Notebook figure: the token tree (nodes at their depth, the position the rotary
    embedding gives them) beside its mask, node i's row True where it sees node j."""
    from matplotlib.figure import Figure

    from course_lib.serving import tree_mask

    tree = example_tree()
    mask = tree_mask(tree).numpy()
    n = len(tree)
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_tree, ax_mask = fig.subplots(1, 2, width_ratios=[1.2, 1])
    # the tree: x = depth; y: the leaves in depth-first order, a parent between its children
    by_depth = sorted(set(tree.depths))
    pos, leaves = {}, []

    def place(i):
        children = tree.children(i)
        for c in children:
            place(c)
        if not children:
            leaves.append(i)
            y = -float(len(leaves))
        else:
            y = sum(pos[c][1] for c in children) / len(children)
        pos[i] = (tree.depths[i], y)

    place(0)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            (x0, y0), (x1, y1) = pos[parent], pos[i]
            ax_tree.plot([x0, x1], [y0, y1], color="0.5", lw=1.5, zorder=1)
    for i, (x, y) in pos.items():
        ax_tree.scatter([x], [y], s=900, color=C_TREE if i else "0.75", zorder=2)
        ax_tree.text(x, y, str(i), ha="center", va="center", fontsize=12, zorder=3)
    ax_tree.set_xticks(by_depth, [f"depth {d}\n(position L + {d})" for d in by_depth],
                       fontsize=10)
    ax_tree.set_yticks([])
    for side in ("top", "right", "left"):
        ax_tree.spines[side].set_visible(False)
    ax_tree.set_xlim(-0.5, max(by_depth) + 0.5)
    ax_tree.set_title("a token tree: node 0 the last accepted token, siblings the\n"
                      "candidates for one position, one verifying forward for all",
                      loc="left", fontsize=12)
    ax_mask.imshow(mask, cmap="Greens", vmin=0, vmax=1.6)
    ax_mask.set_xticks(range(n), [str(j) for j in range(n)], fontsize=10)
    ax_mask.set_yticks(range(n), [str(i) for i in range(n)], fontsize=10)
    ax_mask.set_xlabel("key: tree node j (every cached key before them is seen)", fontsize=11)
    ax_mask.set_ylabel("query: tree node i", fontsize=11)
    ax_mask.set_title("tree_mask: node i sees itself and its ancestors", loc="left",
                      fontsize=12)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"16_batching_timeline": timeline_figure, "16_token_tree": token_tree_figure}
