"""A paged KV cache in pictures: the block table, a shared block, and copy-on-write.

Introduced in notebooks/13_paged_attention.ipynb (section 4). Two sequences are forked from one
prompt, as in parallel sampling: sequence A holds a 6-token prompt in blocks of 4 tokens, B is
forked from it and shares both blocks (reference count 2, nothing copied), then B writes a
token into the shared, partly filled last block, which is first copied (copy-on-write), and A
writes its own token in place. Every state drawn is the state of a ``course_lib.kvcache``
``PagedKVCache`` after the same calls (``sharing_states``), so the picture cannot drift from
the code. Reference: W. Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023, §4.2 (block tables) and §4.4 (sharing,
copy-on-write), https://arxiv.org/abs/2309.06180.
"""
from __future__ import annotations

from course_lib.diagrams import slides_style as st

BLOCK_SIZE = 4
NUM_BLOCKS = 4
PROMPT = 6
C_PROMPT = "#aecbe6"   # a prompt token
C_TOKEN = {"A": "#f5b971", "B": "#9ed6a5"}   # a token each sequence wrote after the fork
EDGE = "0.3"


def sharing_states() -> list[dict]:
    """The three states drawn, each as ``PagedKVCache`` reports it after the same calls.

    Each state: ``title``, ``tables`` {seq: block table}, ``lengths`` {seq: tokens},
    ``refcount`` {block: count}, ``slots`` {block: [token label or None per slot]},
    ``cow`` (copy-on-write copies so far), ``copied`` {new block: block it was copied from}.
    """
    from course_lib.kvcache import PagedKVCache

    cache = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE)
    slots = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}

    def write(seq, label):
        before = cache.blocks(seq)
        block, offset = cache.append(seq)
        after = cache.blocks(seq)
        copied = {}
        if len(before) == len(after) and before[-1] != after[-1]:  # copy-on-write
            slots[after[-1]] = list(slots[before[-1]])
            copied = {after[-1]: before[-1]}
        slots[block][offset] = label
        return copied

    def snapshot(title, copied=None):
        used = {b for seq in cache.seqs for b in cache.blocks(seq)}
        return {"title": title,
                "tables": {s: cache.blocks(s) for s in cache.seqs},
                "lengths": {s: cache.length(s) for s in cache.seqs},
                "refcount": {b: cache.allocator.refcount(b) for b in sorted(used)},
                "slots": {b: list(slots[b]) for b in sorted(used)},
                "cow": cache.cow_copies, "copied": copied or {}}

    cache.add_sequence("A")
    for i in range(PROMPT):
        write("A", str(i))
    states = [snapshot(f"1 · a prompt of {PROMPT} tokens in blocks of {BLOCK_SIZE}:\n"
                       f"A's block table maps logical → physical")]
    cache.fork("A", "B")
    states.append(snapshot("2 · fork: B shares A's blocks\n(reference counts 2, no K/V copied)"))
    copied = write("B", "b")
    copied.update(write("A", "a"))
    states.append(snapshot("3 · B writes: its shared last block is copied\n(copy-on-write); "
                           "A then writes in place", copied))
    return states


def _block(ax, x, y, w, labels, fontsize, show_tokens):
    """One block of BLOCK_SIZE slots at (x, y), each ``w`` wide; labels say what each holds."""
    from matplotlib.patches import Rectangle

    for i, label in enumerate(labels):
        if label is None:
            face = "white"
        elif label.isdigit():
            face = C_PROMPT
        else:
            face = C_TOKEN[label.upper()]
        ax.add_patch(Rectangle((x + i * w, y), w, 0.8, facecolor=face, edgecolor=EDGE, lw=1.2))
        if show_tokens and label is not None:
            ax.text(x + (i + 0.5) * w, y + 0.4, label, ha="center", va="center",
                    fontsize=fontsize)
    ax.add_patch(Rectangle((x, y), w * len(labels), 0.8, fill=False, edgecolor="0.1", lw=2.2))


def draw_state(ax, state, fontsize=11, show_tokens=True):
    """One state: A's logical blocks (left) and B's (right) point through their block tables
    into the physical blocks of the pool (middle), each with its reference count."""
    w = 0.55
    block_w = w * BLOCK_SIZE
    step = 1.75
    top = 5.6
    x_col = {"A": 0.0, "pool": 4.4, "B": 8.8}
    y_of = [top - step * i for i in range(NUM_BLOCKS)]
    right = 11.4 if "B" in state["tables"] else 7.4  # no column for B before the fork
    st.blank(ax, (-0.9, right), (-0.2, 8.4))
    for key, text in (("A", "sequence A"), ("pool", "physical blocks"), ("B", "sequence B")):
        if key == "B" and "B" not in state["tables"]:
            continue
        ax.text(x_col[key] + block_w / 2, top + 1.75, text, fontsize=fontsize, ha="center",
                va="bottom", weight="bold")
    for b in range(NUM_BLOCKS):
        x, y = x_col["pool"], y_of[b]
        used = b in state["slots"]
        _block(ax, x, y, w, state["slots"][b] if used else [None] * BLOCK_SIZE, fontsize,
               show_tokens and used)
        ref = state["refcount"].get(b, 0)
        ax.text(x + block_w / 2, y + 0.95, f"#{b} · " + (f"ref {ref}" if used else "free"),
                fontsize=fontsize, ha="center", va="bottom",
                color="#b03a2e" if ref > 1 else ("0.15" if used else "0.45"),
                weight="bold" if ref > 1 else "normal")
        if b in state["copied"]:
            src = y_of[state["copied"][b]]
            st.arrow(ax, (x - 0.1, src + 0.2), (x - 0.1, y + 0.6), color="#b03a2e", lw=2.2,
                     connectionstyle="arc3,rad=0.6")
            ax.text(x - 0.75, (src + y) / 2 + 0.4, "copy", fontsize=fontsize, ha="right",
                    va="center", color="#b03a2e", weight="bold")
    for seq, table in state["tables"].items():
        x = x_col[seq]
        length = state["lengths"][seq]
        for j, block in enumerate(table):
            y = y_of[j]
            filled = min(BLOCK_SIZE, length - j * BLOCK_SIZE)
            labels = state["slots"][block][:filled] + [None] * (BLOCK_SIZE - filled)
            _block(ax, x, y, w, labels, fontsize, show_tokens)
            ax.text(x + block_w / 2, y + 0.95, f"logical {j}", fontsize=fontsize, ha="center",
                    va="bottom")
            shared = state["refcount"][block] > 1
            target = y_of[block] + 0.4
            if seq == "A":
                start, end = (x + block_w + 0.05, y + 0.4), (x_col["pool"] - 0.05, target)
            else:
                start, end = (x - 0.05, y + 0.4), (x_col["pool"] + block_w + 0.05, target)
            st.arrow(ax, start, end, color="#b03a2e" if shared else "0.3", lw=1.8)
        ax.text(x + block_w / 2, y_of[len(table)] + 0.5, f"table {seq}\n{table}",
                fontsize=fontsize, ha="center", va="center", family="monospace")
    ax.set_title(state["title"], fontsize=fontsize + 1, loc="left")


def paged_sharing_figure():
    """Notebook figure: the three states side by side, tokens labelled."""
    from matplotlib.figure import Figure

    states = sharing_states()
    fig = Figure(figsize=(15, 4.9), layout="constrained")
    axes = fig.subplots(1, len(states), width_ratios=[9.6, 12.3, 12.3])
    for ax, state in zip(axes, states):
        draw_state(ax, state, fontsize=12)
    return fig


def slides_paged_sharing_figure():
    """Slide figure (1160 × 440 slide px): fork and copy-on-write, the two states a room needs;
    text at ``slides_style.MIN_PT`` or larger."""
    states = sharing_states()[1:]
    fig = st.slide_figure(1160, 440)
    for ax, state in zip(fig.subplots(1, len(states)), states):
        draw_state(ax, state, fontsize=st.MIN_PT, show_tokens=False)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"13_paged_sharing": paged_sharing_figure,
           "slides_paged_sharing": slides_paged_sharing_figure}
