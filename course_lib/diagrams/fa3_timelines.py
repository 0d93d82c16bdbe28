"""Timelines of FlashAttention-3's three ideas, and of the course's pinned max.

Introduced in notebooks/09_hopper.ipynb (section 5, and section 6 for the pinned max); the
``slides_`` versions are drawn for the lecture room (deck 05). Each picture is a schedule, not a
measurement: the bar lengths follow the two numbers per score element of an H100 SXM
(``course_lib.analysis.hopper.score_costs``: tensor-core time of QKᵀ and of P·V, and the
softmax's exp2 and FP32 time), at head dim 128 unless a function says otherwise.

* ``warp_specialisation``: a producer warp issues TMA copies of K_j, V_j into a ring of two
  shared-memory stages; the consumer warpgroups only compute. A stage is refilled once the
  consumers have released it (Shah et al. 2024, §3.1, "warp-specialization").
* ``pingpong``: two consumer warpgroups on one SM; a barrier orders their GEMMs so that one's
  softmax runs while the other's GEMMs hold the tensor cores (§3.1, "pingpong scheduling").
* ``intra_warpgroup``: inside one warpgroup, QKᵀ of block j and P·V of block j−1 are issued
  back to back, and the softmax of block j runs while P·V of block j−1 is on the tensor cores
  (§3.2, Algorithm 2; the forward main loop of hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp in the
  flash-attention repository does "gemm0 for iter n_block, gemm1 for iter n_block + 1, and
  softmax for iter n_block").
* ``pinned_chain``: one key block's chain of dependent steps with the running max and with the
  pinned max, this course's own change (``flash_v2_hopper.PINNED_MAX``). Its published family:
  FlashDecoding++'s unified max (Hong et al. 2023, §3) and FlashAttention-4's conditional
  rescaling (Zadouri et al. 2026; ``rescale_threshold`` in flash_attn/cute of the
  flash-attention repository).

References: J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani, T. Dao, "FlashAttention-3:
Fast and Accurate Attention with Asynchrony and Low-precision", arXiv 2407.08608 (2024);
K. Hong et al., "FlashDecoding++: Faster Large Language Model Inference on GPUs", arXiv
2311.01282 (2023); T. Zadouri, M. Hoehnerbach, J. Shah, T. Liu, V. Thakkar, T. Dao,
"FlashAttention-4: Algorithm and Kernel Pipelining Co-Design for Asymmetric Hardware Scaling",
arXiv 2603.05451 (2026); https://github.com/Dao-AILab/flash-attention.
"""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

GEMM = "#3a923a"       # tensor cores: QKᵀ
GEMM_PV = "#8fd18f"    # tensor cores: P·V
SOFTMAX = "#d9483b"    # CUDA cores: exp2, sums, max
LOAD = "#4a78c2"       # TMA copies
SUB = "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089"  # subscript digits


def _style(slide: bool) -> dict:
    """Sizes for the notebook (text >= 10 pt) or for a 1280×720 slide (text >= 16 pt on a
    12-inch-wide figure: at least 18 slide pixels when drawn 1000 px wide or more)."""
    if slide:
        return {"w": 12.0, "row_h": 0.95, "title": 20, "label": 18, "text": 16, "bar": 0.62}
    return {"w": 10.0, "row_h": 0.62, "title": 12, "label": 11, "text": 10, "bar": 0.62}


def durations(D: int = 128) -> dict:
    """Per key block, in units of one QKᵀ: QKᵀ and P·V take 1 each (2·D FLOPs per score
    element each on the tensor cores), the softmax takes softmax_ps / (mma_ps / 2)."""
    from course_lib.analysis.hopper import score_costs

    c = score_costs(D)
    half = c["mma_ps"] / 2
    return {"qk": 1.0, "pv": 1.0, "softmax": c["softmax_ps"] / half, "D": D}


def _bar(ax, y, start, length, color, label="", st=None, text_color="black", hatch=None,
         edge="white"):
    ax.barh(y, length, left=start, height=st["bar"], color=color, edgecolor=edge, lw=1.2,
            hatch=hatch)
    if label:
        ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=st["text"],
                color=text_color)


def _frame(ax, rows: list[str], st: dict, xmax: float) -> None:
    ax.set_yticks(range(len(rows)), rows, fontsize=st["label"])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, xmax)
    ax.set_xticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)


def _time_arrow(ax, st: dict, text: str = "time") -> None:
    ax.set_xlabel(text + " →", fontsize=st["label"], loc="right")


# ---------------------------------------------------------------------------------------------
# 1. warp specialisation with TMA (§3.1)
# ---------------------------------------------------------------------------------------------

def schedule_warp_specialisation(blocks: int = 5, stages: int = 2, load: float = 2.4,
                                 D: int = 128) -> dict:
    """Producer/consumer schedule: load j may start once stage j mod ``stages`` is free (block
    j − stages finished), block j may start once its load arrived and block j − 1 finished."""
    d = durations(D)
    work = d["qk"] + d["softmax"] + d["pv"]
    loads, comp = [], []
    for j in range(blocks):
        issue = 0.15 * j if j < stages else comp[j - stages][1]
        loads.append((issue, issue + load))
        start = max(loads[j][1], comp[j - 1][1] if j else 0.0)
        comp.append((start, start + work))
    return {"loads": loads, "blocks": comp, "d": d, "stages": stages}


def warp_specialisation(slide: bool = False) -> Figure:
    """The producer warp's TMA copies run ahead of the consumers, in a ring of two stages."""
    st = _style(slide)
    s = schedule_warp_specialisation(blocks=3 if slide else 5)
    d = s["d"]
    end = s["blocks"][-1][1]
    fig = Figure(figsize=(st["w"], 2 * st["row_h"] + 1.6), layout="constrained")
    ax = fig.subplots()
    for j, (a, b) in enumerate(s["loads"]):
        y = -0.17 if j % 2 == 0 else 0.17  # two copies can be in flight at once
        ax.barh(y, b - a, left=a, height=0.3, color=LOAD, edgecolor="white")
        text = f"K{SUB[j]}V{SUB[j]}" + ("" if slide else f" → stage {j % s['stages']}")
        ax.text((a + b) / 2, y, text, ha="center", va="center", fontsize=st["text"],
                color="white")
        if j >= s["stages"]:  # the stage is free: block j - stages is done with it
            ax.annotate("", xy=(a, y + 0.15), xytext=(a, 1 - st["bar"] / 2),
                        arrowprops={"arrowstyle": "->", "color": LOAD, "lw": 1.2, "ls": "--"})
    for j, (a, _) in enumerate(s["blocks"]):
        x = a
        for key, color, name in (("qk", GEMM, f"S{SUB[j]}"), ("softmax", SOFTMAX, "softmax"),
                                 ("pv", GEMM_PV, "P·V")):
            _bar(ax, 1, x, d[key], color, name, st,
                 text_color="white" if color in (GEMM, SOFTMAX) else "black")
            x += d[key]
        ax.annotate("", xy=(a, 1 - st["bar"] / 2), xytext=(s["loads"][j][1], 0.05),
                    arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 1.2})
    _frame(ax, ["producer warp:\nTMA copies" if slide else "producer warp\n(TMA copies)",
                "consumer\nwarpgroups"], st, end * 1.01)
    _time_arrow(ax, st)
    ax.set_title("Warp specialisation: one warp only issues TMA copies into a ring of 2 "
                 "stages; the consumers only compute" if not slide else
                 "A producer warp fills 2 stages, the consumer warpgroups compute",
                 fontsize=st["title"], loc="left")
    ax.legend(handles=[Patch(color=LOAD, label="TMA copy in flight"),
                       Patch(color=GEMM, label="QKᵀ (tensor cores)"),
                       Patch(color=SOFTMAX, label="softmax (CUDA cores)"),
                       Patch(color=GEMM_PV, label="P·V (tensor cores)")],
              fontsize=st["text"], ncols=2 if slide else 4, loc="upper center",
              bbox_to_anchor=(0.5, -0.12), frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# 2. ping-pong between two warpgroups (§3.1)
# ---------------------------------------------------------------------------------------------

def schedule_pingpong(blocks: int = 6, warpgroups: int = 2, D: int = 128) -> dict:
    """Each warpgroup runs QKᵀ(0), softmax(0), [P·V(0), QKᵀ(1)], softmax(1), ..., P·V(last);
    its GEMM groups take the tensor cores in turn (warpgroup 1, 2, 1, 2, ...), its softmax runs
    on its own. ``blocks`` key blocks in all, split evenly over the warpgroups."""
    d = durations(D)
    per = blocks // warpgroups
    groups = []  # per warpgroup: GEMM groups [(name, block)]; a softmax after all but the last
    for _ in range(warpgroups):
        g = [[("qk", 0)]]
        for j in range(1, per):
            g.append([("pv", j - 1), ("qk", j)])
        g.append([("pv", per - 1)])
        groups.append(g)
    tc_free, wg_t = 0.0, [0.0] * warpgroups
    gemms, softmaxes = [], []
    for r in range(per + 1):
        for w in range(warpgroups):
            t = max(tc_free, wg_t[w])
            for name, j in groups[w][r]:
                gemms.append((w, name, j, t, t + d[name]))
                t += d[name]
            tc_free = t
            wg_t[w] = t
            if r < per:
                softmaxes.append((w, r, t, t + d["softmax"]))
                wg_t[w] = t + d["softmax"]
    end = max(wg_t + [tc_free])
    busy = sum(b - a for *_, a, b in gemms)
    return {"gemms": gemms, "softmax": softmaxes, "end": end, "tc_busy": busy / end, "d": d,
            "warpgroups": warpgroups}


def _draw_schedule(ax, s: dict, st: dict, labels: list[str], xmax: float) -> None:
    """GEMM bars on each warpgroup's row and on the tensor cores' row, softmax bars on the
    warpgroups' rows."""
    n = s["warpgroups"]
    for w, name, j, a, b in s["gemms"]:
        color = GEMM if name == "qk" else GEMM_PV
        text = f"S{SUB[j]}" if name == "qk" else f"P{SUB[j]}V"
        tc = "white" if name == "qk" else "black"
        _bar(ax, w, a, b - a, color, text, st, text_color=tc)
        _bar(ax, n, a, b - a, color, "", st)
    for w, j, a, b in s["softmax"]:
        _bar(ax, w, a, b - a, SOFTMAX, "softmax" if st["text"] < 14 else "", st,
             text_color="white")
    _frame(ax, labels, st, xmax)
    ax.axvline(s["end"], color="0.3", ls="--", lw=1.2)


def pingpong(slide: bool = False) -> Figure:
    """One warpgroup alone (tensor cores idle during its softmax) against two in ping-pong
    (one's softmax under the other's GEMMs): the same six key blocks (four on the slide)."""
    st = _style(slide)
    blocks = 4 if slide else 6
    one, two = (schedule_pingpong(blocks, warpgroups=w) for w in (1, 2))
    xmax = max(one["end"], two["end"]) * 1.01
    height = 5.6 if slide else 5 * st["row_h"] + 2.4
    fig = Figure(figsize=(st["w"], height), layout="constrained")
    ax1, ax2 = fig.subplots(2, 1, height_ratios=[2, 3])
    _draw_schedule(ax1, one, st, ["warpgroup 1", "tensor cores"], xmax)
    _draw_schedule(ax2, two, st, ["warpgroup 1", "warpgroup 2", "tensor cores"], xmax)
    titles = (("one warpgroup: GEMMs, then softmax, then GEMMs", "one warpgroup"),
              ("ping-pong: warpgroup 2's GEMMs run during warpgroup 1's softmax, and back",
               "two warpgroups in ping-pong"))
    for ax, s, (long, short) in zip((ax1, ax2), (one, two), titles):
        ax.set_title(f"{short if slide else long}: tensor cores busy {s['tc_busy']:.0%}",
                     fontsize=st["title"] if not slide else st["label"], loc="left")
    _time_arrow(ax2, st, f"time, the same {'four' if slide else 'six'} key blocks")
    fig.legend(handles=[Patch(color=GEMM, label="QKᵀ (tensor cores)"),
                        Patch(color=GEMM_PV, label="P·V (tensor cores)"),
                        Patch(color=SOFTMAX, label="softmax (CUDA cores)")],
               fontsize=st["text"], ncols=3, loc="outside lower center", frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# 3. softmax under the previous block's P·V, inside one warpgroup (§3.2)
# ---------------------------------------------------------------------------------------------

def schedule_intra_warpgroup(blocks: int = 4, overlap: bool = True, D: int = 128) -> dict:
    """One warpgroup's key loop. In order: QKᵀ(j), softmax(j), P·V(j). Overlapped (Algorithm 2
    of the paper): issue QKᵀ(j) and P·V(j−1) back to back; softmax(j) starts when S(j) is
    there and runs while P·V(j−1) is on the tensor cores; the next step waits for both."""
    d = durations(D)
    gemms, softmaxes, t = [], [], 0.0
    if not overlap:
        for j in range(blocks):
            gemms.append((0, "qk", j, t, t + d["qk"]))
            t += d["qk"]
            softmaxes.append((0, j, t, t + d["softmax"]))
            t += d["softmax"]
            gemms.append((0, "pv", j, t, t + d["pv"]))
            t += d["pv"]
    else:
        gemms.append((0, "qk", 0, 0.0, d["qk"]))
        t = d["qk"]
        softmaxes.append((0, 0, t, t + d["softmax"]))
        t += d["softmax"]
        for j in range(1, blocks):
            gemms.append((0, "qk", j, t, t + d["qk"]))
            gemms.append((0, "pv", j - 1, t + d["qk"], t + d["qk"] + d["pv"]))
            softmaxes.append((0, j, t + d["qk"], t + d["qk"] + d["softmax"]))
            t += d["qk"] + max(d["pv"], d["softmax"])
        gemms.append((0, "pv", blocks - 1, t, t + d["pv"]))
        t += d["pv"]
    busy = sum(b - a for *_, a, b in gemms)
    return {"gemms": gemms, "softmax": softmaxes, "end": t, "tc_busy": busy / t, "d": d}


def intra_warpgroup(slide: bool = False) -> Figure:
    """One warpgroup, four key blocks: in order, and with the softmax of block j under the P·V
    of block j − 1."""
    st = _style(slide)
    plain = schedule_intra_warpgroup(overlap=False)
    over = schedule_intra_warpgroup(overlap=True)
    xmax = max(plain["end"], over["end"]) * 1.01
    height = 5.0 if slide else 4 * st["row_h"] + 2.2
    fig = Figure(figsize=(st["w"], height), layout="constrained")
    axes = fig.subplots(2, 1)
    titles = (("in order: QKᵀ, softmax, P·V, next block", "in order"),
              ("overlapped: issue S\u2C7C = QK\u2C7Cᵀ, then P\u2C7C\u208B\u2081V; "
               "softmax\u2C7C runs under P\u2C7C\u208B\u2081V",
               "softmax\u2C7C under P\u2C7C\u208B\u2081V"))
    for ax, s, (long, short) in zip(axes, (plain, over), titles):
        for _, name, j, a, b in s["gemms"]:
            color = GEMM if name == "qk" else GEMM_PV
            text = f"S{SUB[j]}" if name == "qk" else f"P{SUB[j]}V"
            _bar(ax, 0, a, b - a, color, text, st,
                 text_color="white" if name == "qk" else "black")
        for _, j, a, b in s["softmax"]:
            _bar(ax, 1, a, b - a, SOFTMAX, f"softmax{SUB[j]}", st, text_color="white")
        _frame(ax, ["tensor cores", "CUDA cores"], st, xmax)
        ax.axvline(s["end"], color="0.3", ls="--", lw=1.2)
        ax.set_title(f"{short if slide else long}: tensor cores busy {s['tc_busy']:.0%}",
                     fontsize=st["title"] if not slide else st["label"], loc="left")
    _time_arrow(axes[1], st, "time, one warpgroup, four key blocks")
    return fig


# ---------------------------------------------------------------------------------------------
# 4. the pinned max: a shorter chain per key block (the course's own change)
# ---------------------------------------------------------------------------------------------

CHAIN = [  # (step, colour, kept with the pinned max)
    ("S = QKᵀ", GEMM, True),
    ("row max\nacross threads", SOFTMAX, False),
    ("exp2,\nrow sums", SOFTMAX, True),
    ("α,\nrescale O", SOFTMAX, False),
    ("O += P·V", GEMM_PV, True),
]


def pinned_chain(slide: bool = False) -> Figure:
    """The dependent steps of one key block, with the running max and with the pinned max:
    after the first block the reference stays fixed, so the row max, α and the rescaling of O
    leave the chain. Schematic lengths."""
    st = _style(slide)
    lengths = {"S = QKᵀ": 1.0, "row max\nacross threads": 1.6, "exp2,\nrow sums": 1.2,
               "α,\nrescale O": 1.2, "O += P·V": 1.1}
    height = 2 * st["row_h"] + (2.6 if slide else 2.0)
    fig = Figure(figsize=(st["w"], height), layout="constrained")
    ax = fig.subplots()
    total = sum(lengths.values())
    for y, pinned in ((0, False), (1, True)):
        x = 0.0
        for name, color, kept in CHAIN:
            if pinned and not kept:
                continue
            w = lengths[name]
            tc = "white" if color in (GEMM, SOFTMAX) else "black"
            _bar(ax, y, x, w, color, name, st, tc)
            if x > 0:
                ax.annotate("", xy=(x + 0.03, y), xytext=(x - 0.09, y),
                            arrowprops={"arrowstyle": "->", "lw": 1.5, "color": "black"})
            x += w
        ax.text(x + 0.06, y, "next block: sooner" if pinned else "next block", va="center",
                fontsize=st["text"])
    _frame(ax, ["running max", "pinned max"], st, total * 1.2)
    _time_arrow(ax, st, "one key block's dependent steps (schematic)")
    title = ("Pinned max (this course's own): a shorter chain" if slide else
             "The pinned max, this course's own change: after the first key block the "
             "reference stays put")
    ax.set_title(title, fontsize=st["title"], loc="left", pad=st["title"] * 2.2)
    ax.text(0, 1.0, "its published family: FlashDecoding++'s unified max · FlashAttention-4's "
            "conditional rescaling", transform=ax.transAxes, fontsize=st["text"], color="0.3",
            va="bottom")
    return fig


FIGURES = {
    "09_fa3_warp_specialisation": warp_specialisation,
    "09_fa3_pingpong": pingpong,
    "09_fa3_intra_warpgroup": intra_warpgroup,
    "09_pinned_max_chain": pinned_chain,
    "slides_fa3_warp_specialisation": lambda: warp_specialisation(slide=True),
    "slides_fa3_pingpong": lambda: pingpong(slide=True),
    "slides_fa3_intra_warpgroup": lambda: intra_warpgroup(slide=True),
    "slides_pinned_max_chain": lambda: pinned_chain(slide=True),
}
"""Image stem -> a function returning the Figure (notebook versions, then slide versions)."""
