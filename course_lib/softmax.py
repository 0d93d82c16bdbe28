"""Softmax from naive to online and blocked, in NumPy, over the last axis of any shape.

Introduced in notebooks/01_softmax.ipynb (the algorithms, their counted cost, the merge) and
notebooks/01b_softmax_numerics.ipynb (overflow, underflow, log-sum-exp, masked rows).

Every function works on the last axis of an array of any leading shape and computes in the
input's own floating dtype (no upcast), so the lessons can show what float16 and float32 do.
The algorithms are written as a GPU kernel with one thread per row would run them: a loop over
the row, with only a few numbers per row (``m``, ``d``) kept between elements. Each loop over
the row is a *pass* that reads ``x`` again from memory. ``course_lib.opcount`` runs these very
functions on instrumented arrays to count their FLOPs and memory accesses.

=====================  ======  ==========================================================
function               passes  per row
=====================  ======  ==========================================================
``naive_softmax``      2       d = Σ e^{x_j};  y_i = e^{x_i} / d
``safe_softmax``       3       m = max x;  d = Σ e^{x_j − m};  y_i = e^{x_i − m} / d
``online_softmax``     2       (m, d) in one pass with the rescale d·e^{m_old − m_new}; output
``blocked_online_...`` 2       each block's (m, d) on its own (``tile_md``), merged with ⊕; output
``fused_softmax``      1       the whole row held on chip: read once, write once
=====================  ======  ==========================================================

Glossary (as in the FlashAttention papers): ``m`` the running maximum (``m_i``), ``d`` the
normaliser Σ e^{x_j − m} (``l_i``), ``lse = m + log d`` the log-sum-exp.

Masked entries are ``-inf``. A row with at least one finite entry gets the exact softmax; a row
that is entirely ``-inf`` gets NaN, as ``torch.softmax`` does (0/0: the softmax of nothing is
undefined). A state with m = -inf means "nothing unmasked seen yet": ``merge_md`` treats it as
the identity whatever its d (the canonical identity is (-inf, 0)).

References: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018),
arXiv:1805.02867, Algorithms 1-3 and the ⊕ operator of §3.1; Dao et al., FlashAttention (2022),
§3.1, arXiv:2205.14135.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "naive_softmax", "safe_softmax", "online_softmax", "blocked_online_softmax",
    "fused_softmax", "online_update", "merge_md", "online_md", "tile_md", "block_md",
    "reduce_md",
    "max_pass", "sum_exp_pass", "output_pass", "logsumexp", "naive_logsumexp", "exp_limits",
    "FIGURES",
]


# ----------------------------------------------------------------------------- input checks
def _as_float(x):
    """An array with a floating dtype; instrumented arrays (``opcount``) pass through."""
    if not isinstance(x, np.ndarray) and hasattr(x, "__array_function__"):
        return x  # a duck array such as opcount.Tracked
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension: softmax runs over the last axis")
    return x if x.dtype.kind == "f" else x.astype(np.float64)


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _without_neg_inf(m):
    """m with -inf replaced by 0, so that ``x - m`` never computes -inf - (-inf) = NaN.

    Where the maximum is -inf every entry seen is -inf; ``e^{-inf - 0} = 0`` then gives the
    right (empty) normaliser. FlashAttention's kernels use the same guard.
    """
    return np.where(m == -np.inf, 0.0, m)


# ----------------------------------------------------------------------------- the passes
def max_pass(x):
    """One pass: the row maximum m, with s - 1 pairwise maxima per row of length s."""
    m = x[..., 0]
    for j in range(1, x.shape[-1]):
        m = np.maximum(m, x[..., j])
    return m  # (...)


def sum_exp_pass(x, m=None):
    """One pass: d = Σ_j e^{x_j - m} (or Σ_j e^{x_j} when m is None), s - 1 additions per row."""
    def term(j):
        xj = x[..., j]
        return np.exp(xj if m is None else xj - m)

    d = term(0)
    for j in range(1, x.shape[-1]):
        d = d + term(j)
    return d  # (...)


def output_pass(x, m, d, block_size=1):
    """The last pass: y = e^{x - m} / d (m None: e^x / d), ``block_size`` elements at a time."""
    y = np.empty_like(x)
    m_col = None if m is None else m[..., None]                 # (..., 1)
    d_col = d[..., None]                                        # (..., 1)
    for lo in range(0, x.shape[-1], block_size):
        tile = x[..., lo:lo + block_size]                       # (..., B)
        y[..., lo:lo + block_size] = np.exp(tile if m is None else tile - m_col) / d_col
    return y  # (..., s)


def _empty_result(x):
    return np.empty_like(x) if x.shape[-1] == 0 else None


def _empty_state(shape, dtype):
    """The identity of ⊕, (-inf, 0), for every position of ``shape``."""
    return np.full(shape, -np.inf, dtype), np.zeros(shape, dtype)


# ----------------------------------------------------------------------------- softmaxes
def naive_softmax(x):
    """softmax(x) = e^x / Σ e^x, literally: two passes, overflows once e^x does.

    e^x overflows to inf for x > 88.7 in float32 and x > 11.1 in float16; then inf/inf = NaN.
    """
    x = _as_float(x)
    if (empty := _empty_result(x)) is not None:
        return empty
    d = sum_exp_pass(x)                 # pass 1: d = Σ e^{x_j}
    return output_pass(x, None, d)      # pass 2: y = e^x / d


def safe_softmax(x):
    """softmax(x) = e^{x - m} / Σ e^{x - m} with m = max(x): three passes, never overflows."""
    x = _as_float(x)
    if (empty := _empty_result(x)) is not None:
        return empty
    m = max_pass(x)                     # pass 1: m = max_j x_j
    d = sum_exp_pass(x, m)              # pass 2: d = Σ e^{x_j - m}
    return output_pass(x, m, d)         # pass 3: y = e^{x - m} / d


def online_update(m, d, x_j):
    """Fold one more element into the state: m' = max(m, x_j), d' = d·e^{m - m'} + e^{x_j - m'}.

    This is ``merge_md(m, d, x_j, 1)`` with the multiplication by 1 left out.
    """
    m_new = np.maximum(m, x_j)
    m_ref = _without_neg_inf(m_new)     # all seen so far masked: keep d at 0, not NaN
    d_new = d * np.exp(m - m_ref) + np.exp(x_j - m_ref)
    return m_new, d_new


def online_md(x):
    """One pass for (m, d) of every row: m = max x, d = Σ e^{x - m} (Milakov & Gimelshein, Alg. 3).

    The state starts from the first element (m = x_0, d = e^0 = 1), so a row of length s costs
    s - 1 updates. An empty row gives (-inf, 0).
    """
    x = _as_float(x)
    if x.shape[-1] == 0:
        return _empty_state(x.shape[:-1], x.dtype)
    m = x[..., 0]
    d = np.ones_like(m)
    for j in range(1, x.shape[-1]):
        m, d = online_update(m, d, x[..., j])
    return m, d  # (...), (...)


def online_softmax(x):
    """Online softmax: one pass for (m, d) with the rescale d·e^{m_old - m_new}, then the output."""
    x = _as_float(x)
    if (empty := _empty_result(x)) is not None:
        return empty
    m, d = online_md(x)                 # pass 1: running max and normaliser together
    return output_pass(x, m, d)         # pass 2: y = e^{x - m} / d


def merge_md(m1, d1, m2, d2):
    """The merge ⊕ of two partial states: (m1, d1) ⊕ (m2, d2) = (m, d1·e^{m1-m} + d2·e^{m2-m}).

    m = max(m1, m2). Commutative and associative, with identity (-inf, 0), so partial results
    over any split of a row can be merged in any order. Works elementwise on arrays.
    """
    m = np.maximum(m1, m2)
    m_ref = _without_neg_inf(m)         # both parts empty: (-inf, 0), not NaN
    d = d1 * np.exp(m1 - m_ref) + d2 * np.exp(m2 - m_ref)
    return m, d


def tile_md(tile):
    """(m, d) of one block held whole, every row on its own: m = max, d = Σ e^{x − m}.

    What a kernel does with a tile it has loaded: a max, an exp and a sum over the last axis.
    A block that is entirely -inf gives the empty state (-inf, 0). Returns two arrays of shape
    tile.shape[:-1] (scalars for one row).
    """
    tile = _as_float(tile)
    m = np.max(tile, axis=-1)                                   # (...)
    e = np.exp(tile - _without_neg_inf(m)[..., None])           # (..., B)
    return m, np.sum(e, axis=-1)                                # (...), (...)


def _block_stats(x, block_size):
    """Yield (m, d) of each block of ``block_size`` elements along the last axis, in order."""
    for lo in range(0, x.shape[-1], block_size):
        yield tile_md(x[..., lo:lo + block_size])               # (..., B) -> (...), (...)


def block_md(x, block_size):
    """(m, d) of each block of ``block_size`` elements along the last axis, each on its own.

    The last block is shorter when block_size does not divide the row length. Returns two
    arrays of shape (..., n_blocks). Inside a block the work is a tile: max, exp, sum.
    """
    x = _as_float(x)
    stats = list(_block_stats(x, _check_block_size(block_size)))
    if not stats:
        return _empty_state(x.shape[:-1] + (0,), x.dtype)
    return (np.stack([m for m, _ in stats], axis=-1),            # (..., n_blocks)
            np.stack([d for _, d in stats], axis=-1))            # (..., n_blocks)


def reduce_md(m, d, order=None):
    """Merge partial states along the last axis into one (m, d) per row.

    ``order``: None merges left to right; "tree" merges neighbours pairwise (as parallel
    threads would); a sequence of indices merges in that order. Every order gives the same
    result up to rounding: ⊕ is associative and commutative.
    """
    n = m.shape[-1]
    if n == 0:
        return _empty_state(m.shape[:-1], m.dtype)
    parts = [(m[..., k], d[..., k]) for k in range(n)]
    if isinstance(order, str):
        if order != "tree":
            raise ValueError(f"order must be None, 'tree' or a permutation, got {order!r}")
        while len(parts) > 1:
            merged = [merge_md(*a, *b) for a, b in zip(parts[0::2], parts[1::2])]
            parts = merged + parts[len(merged) * 2:]
        return parts[0]
    if order is not None:
        order = [int(k) for k in order]
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must be a permutation of range({n}), got {order}")
        parts = [parts[k] for k in order]
    return _fold(parts)


def _fold(states):
    """Merge (m, d) states left to right; ``states`` may be a generator (nothing is kept)."""
    states = iter(states)
    state = next(states)
    for part in states:
        state = merge_md(*state, *part)
    return state


def blocked_online_softmax(x, block_size, order=None):
    """Softmax from blocks: each block's (m, d) computed independently, then merged with ⊕.

    Any block size works, including ones that do not divide the row length. With ``order``
    None the blocks are merged as they come, left to right, as one FlashAttention thread block
    walks a row; otherwise every block's (m, d) is kept and ``reduce_md`` merges them in that
    order ("tree" or a permutation), as split-KV decoding merges partial results.
    """
    x = _as_float(x)
    block_size = _check_block_size(block_size)
    if (empty := _empty_result(x)) is not None:
        return empty
    if order is None:                                         # pass 1: blocks, merged as met
        m, d = _fold(_block_stats(x, block_size))
    else:                                                     # pass 1: all blocks, then ⊕
        m, d = reduce_md(*block_md(x, block_size), order=order)
    return output_pass(x, m, d, block_size)                   # pass 2: y = e^{x - m} / d


def fused_softmax(x):
    """Safe softmax with the whole row held on chip: one read and one write per element.

    What a fused GPU kernel does when a row fits in registers/shared memory (Triton's
    fused-softmax tutorial): load the row, compute m, e = e^{x - m} once, d = Σ e, store e / d.
    """
    x = _as_float(x)
    if (empty := _empty_result(x)) is not None:
        return empty
    row = x[..., :]                                 # (..., s): the one read of x
    m = np.max(row, axis=-1)                        # (...)
    e = np.exp(row - m[..., None])                  # (..., s)
    y = np.empty_like(x)
    y[...] = e / np.sum(e, axis=-1)[..., None]      # the one write of y
    return y


# ----------------------------------------------------------------------------- log-sum-exp
def logsumexp(x):
    """LSE(x) = log Σ e^x, computed stably as m + log d from one online pass.

    -inf for a row that is entirely -inf, like ``torch.logsumexp``.
    """
    m, d = online_md(x)
    with np.errstate(divide="ignore"):  # log 0 = -inf for a fully masked row
        return m + np.log(d)


def naive_logsumexp(x):
    """log Σ e^x, literally: inf once any e^x overflows."""
    return np.log(sum_exp_pass(_as_float(x)))


# ----------------------------------------------------------------------------- figures
def exp_limits(dtype) -> dict:
    """Where e^x stops being an ordinary number in ``dtype``, measured on a grid of x in steps
    of 1/1024 (float16's overflow, ln 65504 ≈ 11.09, lies between two points of a 1/64 grid).

    Returns the largest x with e^x finite (above it: inf), the smallest x with e^x a normal
    number (below it: subnormal, fewer significant bits) and the smallest x with e^x > 0
    (below it: 0). Computed by evaluating ``np.exp`` in ``dtype``, not from formulas.
    """
    dtype = np.dtype(dtype)
    x = np.arange(-800.0, 800.0, 1 / 1024)  # fine enough that float16's limit prints as 11.09
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(x.astype(dtype))
    finite, positive = np.isfinite(e), e > 0
    normal = positive & (e >= np.finfo(dtype).smallest_normal)
    return {"overflow_above": float(x[finite].max()), "subnormal_below": float(x[normal].min()),
            "zero_below": float(x[positive].min())}


#: The overflow figure draws softmax errors below this many ulps (ε of the dtype) at the bound:
#: 16 logits, an exp of a few ulps, a sum of 16 terms and a division stay under it.
ROUNDING_ULPS = 32


#: What e^x is in each region of x, left to right, and its colour in the overflow figure.
EXP_REGIONS = (("0 (underflow)", "#9ecae1"), ("subnormal", "#fdae6b"), ("normal", "#c7e9c0"),
               ("inf (overflow)", "#fb6a4a"))


def _exp_regions(dtype) -> list[tuple[float, float, str]]:
    """[(x from, x to, region)] of e^x in ``dtype``, from the measured ``exp_limits``."""
    lim = exp_limits(dtype)
    edges = (-np.inf, lim["zero_below"], lim["subnormal_below"], lim["overflow_above"], np.inf)
    return [(lo, hi, name) for lo, hi, (name, _) in zip(edges, edges[1:], EXP_REGIONS)]


def _exp_bands(fig, box, dtypes, fontsize):
    """Per dtype a band along x coloured by what e^x is there: 0, subnormal, normal, inf, each
    boundary labelled by its value. The x axis is broken in three, one scale throughout:
    float64's underflow, the middle (float16's and float32's limits, the right panel's shifts),
    float64's overflow."""
    from matplotlib.patches import Patch, Rectangle

    lim64 = exp_limits(np.float64)
    segments = ((10 * np.floor(lim64["zero_below"] / 10) - 50,
                 10 * np.ceil(lim64["subnormal_below"] / 10) + 40),
                (-140.0, 130.0),
                (10 * np.floor(lim64["overflow_above"] / 10) - 20,
                 10 * np.ceil(lim64["overflow_above"] / 10) + 30))
    left, bottom, width, height = box
    gap = 0.012
    units = sum(hi - lo for lo, hi in segments)
    scale = (width - gap * (len(segments) - 1)) / units          # figure width per unit of x
    axes, x0 = [], left
    for lo, hi in segments:
        ax = fig.add_axes([x0, bottom, scale * (hi - lo), height])
        ax.set(xlim=(lo, hi), ylim=(-0.75, len(dtypes) - 0.35))
        ax.set_yticks([])
        ax.tick_params(labelsize=fontsize)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        axes.append(ax)
        x0 += scale * (hi - lo) + gap
    units_per_inch = 1 / (scale * fig.get_figwidth())
    pad = 0.04 * units_per_inch                                  # a label's gap to its line
    colors = dict(EXP_REGIONS)
    for row, dtype in enumerate(dtypes):
        y = len(dtypes) - 1 - row
        regions = _exp_regions(dtype)
        for ax, (lo, hi) in zip(axes, segments):
            for a, b, name in regions:
                a, b = max(a, lo), min(b, hi)
                if a >= b:
                    continue
                ax.add_patch(Rectangle((a, y - 0.22), b - a, 0.44, facecolor=colors[name],
                                       edgecolor="none"))
                short = {"0 (underflow)": "0", "inf (overflow)": "inf"}.get(name, name)
                if (b - a) / units_per_inch > 0.65 * fontsize / 72 * (len(short) + 1):  # fits
                    ax.text((a + b) / 2, y, short, ha="center", va="center", fontsize=fontsize)
        for (a, _, name), side in zip(regions[1:], ("right", "left", "left")):
            ax = next(ax for ax, (lo, hi) in zip(axes, segments) if lo < a < hi)
            ax.plot([a, a], [y - 0.3, y + 0.3], color="black", lw=1.2)
            below = name == "inf (overflow)"
            ax.text(a + (pad if side == "left" else -pad), y - 0.3 if below else y + 0.3,
                    f"{a:.2f}".replace("-", "−"), ha=side, va="top" if below else "bottom",
                    fontsize=fontsize)
        axes[0].text(segments[0][0] - 2 * pad, y, np.dtype(dtype).name,
                     ha="right", va="center", fontsize=fontsize + 1)
    for ax, (lo, hi) in zip(axes, segments):
        ax.set_xticks(np.arange(np.ceil(lo / 50) * 50, hi, 50))
    for ax, nxt in zip(axes, axes[1:]):          # the breaks: // on the axis line
        for a, x in ((ax, 1.0), (nxt, 0.0)):
            a.plot([x - 0.012 / (a.get_position().width), x + 0.012 / (a.get_position().width)],
                   [-0.03, 0.03], transform=a.transAxes, color="black", lw=1.2, clip_on=False)
    mid = axes[1]
    mid.set_xlabel("x   (the axis is broken at //)", fontsize=fontsize)
    fig.text(left + width / 2, bottom + height + 0.13, "what e^x is in each dtype",
             ha="center", va="bottom", fontsize=fontsize + 2)
    fig.legend(handles=[Patch(facecolor=c, label=n) for n, c in EXP_REGIONS], ncol=4,
               loc="lower center", bbox_to_anchor=(left + width / 2, bottom + height + 0.01),
               fontsize=fontsize, frameon=False, handlelength=1.4, columnspacing=1.2)
    return axes


def overflow_figure():
    """Left: what e^x is (0, subnormal, normal, inf) along x, per dtype, at the measured limits.
    Right: softmax error against a shift.

    Softmax does not change when a constant c is added to a row; naive softmax does: its error
    grows in the subnormal range and becomes NaN once e^x overflows (or all of it underflows).
    """
    import matplotlib.pyplot as plt

    font = 11
    fig = plt.figure(figsize=(13, 4.6))
    _exp_bands(fig, (0.07, 0.15, 0.5, 0.62), (np.float16, np.float32, np.float64), font)
    ax1 = fig.add_axes([0.655, 0.15, 0.34, 0.7])

    z = np.random.default_rng(0).standard_normal(16)
    shifts = np.linspace(-120, 120, 961)
    for dtype, color in ((np.float16, "C3"), (np.float32, "C0")):
        for fn, ls, label in ((naive_softmax, "-", "naive"), (safe_softmax, "--", "safe")):
            errs = []
            for c in shifts:
                xs = (c + z).astype(dtype)                       # the row, rounded to dtype
                ref = safe_softmax(xs.astype(np.float64))        # exact for that rounded row
                with np.errstate(all="ignore"):
                    err = np.abs(fn(xs).astype(np.float64) - ref).max()
                errs.append(err if np.isfinite(err) else np.nan)
            errs = np.asarray(errs)
            # Below ROUNDING_ULPS ulps the error is rounding, whose last bits depend on the
            # CPU's exp: drawn at that bound, not by its bits.
            bound = ROUNDING_ULPS * np.finfo(dtype).eps
            ax1.semilogy(shifts, np.maximum(errs, bound), color=color, ls=ls,
                         label=f"{label}, {np.dtype(dtype).name}")
            broken = np.isnan(errs)
            ax1.plot(shifts[broken], np.full(broken.sum(), 3.0), "|", color=color, ms=6)
        ax1.axhline(bound, color=color, lw=0.8, ls=":")
        ax1.text(-88, bound / 1.4, f"{np.dtype(dtype).name} rounding: ≤ {ROUNDING_ULPS} ε",
                 color=color, fontsize=font - 1, va="top")     # below its line: nothing there
    ticks = [1e-6, 1e-4, 1e-2, 1.0, 3.0]
    ax1.set_yticks(ticks, [f"1e{round(np.log10(t))}" for t in ticks[:-1]] + ["NaN"])
    ax1.set(ylim=(1e-7, 10))
    ax1.set_xlabel("shift c added to every logit of a row", fontsize=font)
    ax1.set_ylabel("max |error| against float64", fontsize=font)
    ax1.set_title("softmax(x + c) = softmax(x), but naive softmax breaks", fontsize=font + 1)
    ax1.tick_params(labelsize=font)
    ax1.legend(loc="center", bbox_to_anchor=(0.45, 0.43), fontsize=font - 1)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"01_softmax_overflow": overflow_figure}
