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


def advance(scheduler, steps: int | None = None):
    """Step ``scheduler`` ``steps`` times (None: until every request is done), every sampled
    token a stand-in 0: the pictures need only how many tokens each request asks for. Returns
    the last step's batch."""
    batch = None
    while scheduler.has_unfinished() if steps is None else steps > 0:
        batch = scheduler.step()
        scheduler.update(batch, [0 for c in batch.chunks if c.samples])
        steps = None if steps is None else steps - 1
    return batch


def workload_scheduler(static: bool = False):
    """A ``Scheduler`` with the timeline's ``WORKLOAD`` queued, all arrived at step 0."""
    from course_lib.serving import Scheduler

    s = Scheduler(num_blocks=64, block_size=4, max_tokens_per_step=TOKEN_BUDGET,
                  max_running=MAX_RUNNING, static=static)
    for i, (prompt, new) in enumerate(WORKLOAD):
        s.add_request([i + 1] * prompt, new)
    return s


def timelines() -> dict:
    """{"continuous" | "static": (steps, rows)}: each policy's number of steps and, per
    request, the (step, "prefill" | "decode", tokens) it ran, from ``Scheduler.history``."""
    out = {}
    for name in ("continuous", "static"):
        s = workload_scheduler(static=name == "static")
        advance(s)
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


def tree_layout(tree) -> dict:
    """{node: (x, y)} of a drawing of ``tree``: x its depth, y its place among the leaves in
    depth-first order (a parent midway between its children)."""
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
    return pos


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
    by_depth = sorted(set(tree.depths))
    pos = tree_layout(tree)
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


#: The pool's picture: three requests that start with one 9-token system prompt.
POOL_PROMPTS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41), (1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51, 52, 53),
                (1, 2, 3, 4, 5, 6, 7, 8, 9, 60))
POOL_BLOCKS, POOL_BLOCK_SIZE = 12, 4


def pool_state():
    """The scheduler after the three ``POOL_PROMPTS`` arrived one step apart and each ran its
    prefill: (block tables by request, reference count of every physical block, the names of
    the cached blocks)."""
    from course_lib.serving import Scheduler

    s = Scheduler(num_blocks=POOL_BLOCKS, block_size=POOL_BLOCK_SIZE, max_tokens_per_step=16,
                  max_running=4)
    for i, prompt in enumerate(POOL_PROMPTS):
        s.add_request(list(prompt), max_new_tokens=4, arrival_step=i)
    advance(s, len(POOL_PROMPTS))  # one prefill each; the first token is sampled
    tables = {r.request_id: list(r.block_table) for r in s.requests.values()}
    refcounts = [s.allocator.refcount(b) for b in range(POOL_BLOCKS)]
    return tables, refcounts, len(s.cache)


def block_pool_figure():
    """Notebook figure: each request's block table above the pool's physical blocks, with
    their reference counts (the requests' and the prefix cache's own); the system prompt's two
    full blocks shared by all three requests."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    tables, refcounts, _ = pool_state()
    users = {b: sum(b in t for t in tables.values()) for b in range(POOL_BLOCKS)}
    colors = ("#5dade2", "#f5b041", "#58d68d")
    shared_color = "#af7ac5"
    owner = {b: r for r, t in tables.items() for b in t if users[b] == 1}

    def face(b):
        return shared_color if users[b] > 1 else colors[owner[b]] if b in owner else "white"

    fig = Figure(figsize=(12, 5.6), layout="constrained")
    ax = fig.subplots()
    for b in range(POOL_BLOCKS):
        ax.add_patch(Rectangle((b, 0), 0.9, 0.9, facecolor=face(b), edgecolor="0.3"))
        ax.text(b + 0.45, 0.62, str(b), ha="center", va="center", fontsize=13)
        if refcounts[b]:
            ax.text(b + 0.45, 0.25, f"ref {refcounts[b]}", ha="center", va="center",
                    fontsize=11)
    ax.text(-0.3, 0.45, "physical blocks\n(the pool)", ha="right", va="center", fontsize=12)
    for r, table in tables.items():
        y = 1.6 + 1.1 * (len(tables) - 1 - r)
        ax.text(-0.3, y + 0.45, f"request {r}: {len(POOL_PROMPTS[r]) + 1} tokens\nblock table",
                ha="right", va="center", fontsize=12)
        for j, b in enumerate(table):
            ax.add_patch(Rectangle((j, y), 0.9, 0.9, facecolor=face(b), edgecolor="0.3"))
            ax.text(j + 0.45, y + 0.45, f"→ {b}", ha="center", va="center", fontsize=13)
    ax.legend(handles=[Patch(color=shared_color, label="shared by the three requests"),
                       *[Patch(color=c, label=f"request {r}'s own") for r, c in
                         enumerate(colors)]],
              loc="upper right", fontsize=11, frameon=False)
    ax.set_xlim(-3.6, POOL_BLOCKS + 0.2)
    ax.set_ylim(-0.2, 1.6 + 1.1 * len(tables))
    ax.axis("off")
    ax.set_title(f"blocks of {POOL_BLOCK_SIZE} tokens, a 9-token system prompt: its two full "
                 "blocks are found by their names and shared;\n'ref' counts the requests "
                 "holding a block plus the prefix cache's own hold on every named block",
                 loc="left", fontsize=12)
    return fig


def cascade_figure():
    """Notebook figure: one decode step of four requests as cascade attention: the shared
    prefix as one dense product of every request's query rows, each request's suffix on its
    own, then the merge of the two (o, lse) per row."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Rectangle

    suffix = (3, 5, 2, 4)  # keys of each request after the prefix
    P = 10
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax = fig.subplots()
    colors = ("#5dade2", "#f5b041", "#58d68d", "#ec7063")
    for r, c in enumerate(colors):  # one query row per request
        ax.add_patch(Rectangle((0, 3 - r), 0.8, 0.8, facecolor=c, edgecolor="0.3"))
        ax.text(-0.2, 3.4 - r, f"q of request {r}", ha="right", va="center", fontsize=12)
    # 1. the prefix: one matrix, every request's row against the same P keys
    ax.add_patch(Rectangle((1.2, 0), P * 0.5, 3.8, facecolor="#d2b4de", edgecolor="0.3"))
    ax.text(1.2 + P * 0.25, 1.9, "S = Q · K_prefixᵀ\nfor all rows at once:\nthe prefix's K, V "
            "read once", ha="center", va="center", fontsize=12)
    ax.text(1.2 + P * 0.25, 4.15, "1. the shared prefix (P keys)", ha="center", fontsize=12)
    x0 = 1.2 + P * 0.5 + 0.6  # 2. each request's own keys
    for r, (c, n) in enumerate(zip(colors, suffix)):
        ax.add_patch(Rectangle((x0, 3 - r), n * 0.5, 0.8, facecolor=c, edgecolor="0.3",
                               alpha=0.7))
    ax.text(x0 + 1.25, 4.15, "2. each suffix", ha="center", fontsize=12)
    xm = x0 + 0.5 * max(suffix) + 1.2  # 3. the merge
    for r in range(4):
        ax.add_patch(FancyArrowPatch((xm - 0.9, 3.4 - r), (xm, 3.4 - r), arrowstyle="-|>",
                                     mutation_scale=12, color="0.4"))
        ax.text(xm + 0.1, 3.4 - r, "merge the two (o, lse)", va="center", fontsize=12)
    ax.text(xm + 1.4, 4.15, "3. lesson 12's merge", ha="center", fontsize=12)
    ax.set_xlim(-2.6, xm + 3.4)
    ax.set_ylim(-0.3, 4.6)
    ax.axis("off")
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"16_batching_timeline": timeline_figure, "16_token_tree": token_tree_figure,
           "16_block_pool": block_pool_figure, "16_cascade": cascade_figure}
