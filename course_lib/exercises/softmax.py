"""Exercises of notebooks/01_softmax.ipynb (the online update, the merge ⊕ of (m, d) states,
blocked online softmax from block states and a merge) and notebooks/01b_softmax_numerics.ipynb
(a stable log-sum-exp), and the think-question of 01.

The specs are ``course_lib.softmax.online_update``, ``merge_md``, ``blocked_online_softmax`` and
``logsumexp`` (tested in tests/test_softmax.py). Each checker runs ordinary inputs first, then
masked ones (−∞ entries, rows that are masked so far or entirely), and picks its nudge by what
went wrong: a NaN from −∞ − (−∞), Python's ``max`` on arrays, an output with a kept axis.
``blocked_softmax`` receives the merge as an argument: its checker passes the library's merge
(counting the calls), so it tests the student's loop and not their merge.
"""
from __future__ import annotations

import numpy as np

from course_lib import softmax as sm
from course_lib.exercises import Exercise, Mistake, Question, Result, _report, check, register

NEG_INF = -np.inf


# --- what the notebooks show (tests/test_exercises.py checks the notebooks have this text) ---
def online_update(m, d, x):
    # TODO: the new maximum, then the rescaled old sum plus the new term
    raise NotImplementedError


def merge(m1, d1, m2, d2):
    # TODO: return (m, d), the state of both parts together
    raise NotImplementedError


def blocked_softmax(x, B, merge):
    """Softmax over the last axis of x, B elements at a time: each block's state (m, d) from
    sm.tile_md, the states folded with merge, then the output pass with the row's state."""
    # TODO: the empty state, one per row
    # TODO: each block's state, folded in with merge (the last block may be shorter than B)
    # TODO: the output pass y = e^(x − m) / d, with the merged state
    raise NotImplementedError


def logsumexp(x):
    # TODO: m + log Σ e^(x − m), over the last axis
    raise NotImplementedError


# --- the references ----------------------------------------------------------------------------
def _online_update_solution(m, d, x):
    m_new = np.maximum(m, x)
    m_ref = np.where(m_new == -np.inf, 0.0, m_new)   # nothing unmasked seen yet: subtract 0
    d_new = d * np.exp(m - m_ref) + np.exp(x - m_ref)
    return m_new, d_new


def _merge_solution(m1, d1, m2, d2):
    m = np.maximum(m1, m2)
    m_ref = np.where(m == -np.inf, 0.0, m)            # both parts empty: (−inf, 0), not NaN
    d = d1 * np.exp(m1 - m_ref) + d2 * np.exp(m2 - m_ref)
    return m, d


def _blocked_softmax_solution(x, B, merge):
    """Softmax over the last axis of x, B elements at a time: each block's state (m, d) from
    sm.tile_md, the states folded with merge, then the output pass with the row's state."""
    m = np.full(x.shape[:-1], -np.inf)                # the empty state (−∞, 0), one per row
    d = np.zeros(x.shape[:-1])
    for lo in range(0, x.shape[-1], B):               # the last block may be shorter than B
        m_b, d_b = sm.tile_md(x[..., lo:lo + B])      # this block's state, on its own
        m, d = merge(m, d, m_b, d_b)
    return np.exp(x - m[..., None]) / d[..., None]    # every block with the row's m and d


def _logsumexp_solution(x):
    m = np.max(x, axis=-1, keepdims=True)             # keepdims: x - m broadcasts per row
    m_ref = np.where(m == -np.inf, 0.0, m)            # a fully masked row: log 0 = −inf
    d = np.sum(np.exp(x - m_ref), axis=-1)
    return m_ref[..., 0] + np.log(d)                  # one value per row: the axis dropped


# --- the mistakes students make ----------------------------------------------------------------
def _update_no_rescale(m, d, x):
    m_new = np.maximum(m, x)
    m_ref = np.where(m_new == -np.inf, 0.0, m_new)
    return m_new, d + np.exp(x - m_ref)


def _update_rescale_inverted(m, d, x):
    m_new = np.maximum(m, x)
    m_ref = np.where(m_new == -np.inf, 0.0, m_new)
    return m_new, d * np.exp(m_ref - m) + np.exp(x - m_ref)


def _update_unguarded(m, d, x):
    m_new = np.maximum(m, x)
    return m_new, d * np.exp(m - m_new) + np.exp(x - m_new)


def _update_python_max(m, d, x):
    m_new = max(m, x)
    m_ref = np.where(m_new == -np.inf, 0.0, m_new)
    return m_new, d * np.exp(m - m_ref) + np.exp(x - m_ref)


def _merge_one_side(m1, d1, m2, d2):
    m = np.maximum(m1, m2)
    m_ref = np.where(m == -np.inf, 0.0, m)
    return m, d1 * np.exp(m1 - m_ref) + d2


def _merge_unguarded(m1, d1, m2, d2):
    m = np.maximum(m1, m2)
    return m, d1 * np.exp(m1 - m) + d2 * np.exp(m2 - m)


def _merge_python_max(m1, d1, m2, d2):
    m = max(m1, m2)
    m_ref = np.where(m == -np.inf, 0.0, m)
    return m, d1 * np.exp(m1 - m_ref) + d2 * np.exp(m2 - m_ref)


def _blocked_ragged_dropped(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    for k in range(x.shape[-1] // B):                 # whole blocks only: the tail is lost
        m, d = merge(m, d, *sm.tile_md(x[..., k * B:(k + 1) * B]))
    return np.exp(x - m[..., None]) / d[..., None]


def _blocked_stops_early(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    for lo in range(0, x.shape[-1] - B, B):          # stops one block early, ragged or not
        m, d = merge(m, d, *sm.tile_md(x[..., lo:lo + B]))
    return np.exp(x - m[..., None]) / d[..., None]


def _blocked_rows_for_length(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    for lo in range(0, len(x), B):                    # len(x): the number of rows, for 2-D x
        m, d = merge(m, d, *sm.tile_md(x[..., lo:lo + B]))
    return np.exp(x - m[..., None]) / d[..., None]


def _blocked_own_d(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    y = np.empty_like(x)
    for lo in range(0, x.shape[-1], B):
        m_b, d_b = sm.tile_md(x[..., lo:lo + B])
        m, d = merge(m, d, m_b, d_b)                  # merged, then not used
        y[..., lo:lo + B] = np.exp(x[..., lo:lo + B] - m_b[..., None]) / d_b[..., None]
    return y


def _blocked_last_m(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    for lo in range(0, x.shape[-1], B):
        m_b, d_b = sm.tile_md(x[..., lo:lo + B])
        m, d = merge(m, d, m_b, d_b)
    return np.exp(x - m_b[..., None]) / d[..., None]  # the last block's m, the row's d


def _blocked_zero_state(x, B, merge):
    m, d = np.zeros(x.shape[:-1]), np.zeros(x.shape[:-1])   # (0, 0): "an element 0, weight 0"
    for lo in range(0, x.shape[-1], B):
        m, d = merge(m, d, *sm.tile_md(x[..., lo:lo + B]))
    return np.exp(x - m[..., None]) / d[..., None]


def _blocked_not_broadcast(x, B, merge):
    m, d = np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1])
    for lo in range(0, x.shape[-1], B):
        m, d = merge(m, d, *sm.tile_md(x[..., lo:lo + B]))
    return np.exp(x - m) / d                          # m (rows,) against x (rows, s)


def _blocked_library(x, B, merge):
    return sm.blocked_online_softmax(x, B)            # right values, but the merge is unused


def _lse_naive(x):
    return np.log(np.sum(np.exp(x), axis=-1))


def _lse_keepdims(x):
    m = np.max(x, axis=-1, keepdims=True)
    m_ref = np.where(m == -np.inf, 0.0, m)
    return m_ref + np.log(np.sum(np.exp(x - m_ref), axis=-1, keepdims=True))


def _lse_unguarded(x):
    m = np.max(x, axis=-1, keepdims=True)
    return m[..., 0] + np.log(np.sum(np.exp(x - m), axis=-1))


def _lse_max_not_added_back(x):
    m = np.max(x, axis=-1, keepdims=True)
    m_ref = np.where(m == -np.inf, 0.0, m)
    return np.log(np.sum(np.exp(x - m_ref), axis=-1))


# --- the checkers ------------------------------------------------------------------------------
MASK_NUDGE = ("a NaN where the answer is a number: with only −∞ seen so far, the new maximum is "
              "−∞ and −∞ − (−∞) is NaN. Lesson 01, section 5: where the new maximum is −∞, "
              "subtract 0 instead (np.where chooses per entry); e^(−∞) is then 0, as it should be.")
ARRAY_NUDGE = ("Python's max() compares two whole arrays and cannot decide: the inputs may be "
               "arrays, one entry per row. NumPy has an elementwise maximum.")

UPDATE_HINTS = (
    "the state (m, d) says: d = Σ e^(x_j − m) over the elements seen so far. Compute the new "
    "maximum first, elementwise (m, d and x may be arrays).",
    "d was summed relative to the old maximum. Section 5 multiplies it by a factor that moves "
    "it to the new maximum (it is 1 when the maximum did not change, < 1 when it grew); then "
    "the new element's own term is added, also relative to the new maximum.",
    MASK_NUDGE,
)
MERGE_HINTS = (
    "the merged maximum is the larger of the two, elementwise. Each d was summed relative to "
    "its own maximum.",
    "move both sums to the merged maximum, each with its own factor e^(its maximum − the "
    "merged one), then add them. The online update is the special case (m2, d2) = (x, 1).",
    MASK_NUDGE,
)
BLOCKED_HINTS = (
    "start every row from the state of an empty part, (−∞, 0), one value per row (shape "
    "x.shape[:-1]); then, block after block, merge the block's state into it with the merge "
    "you are given. sm.tile_md(block) gives a block's state.",
    "the blocks start at 0, B, 2B, … as long as the start is below the row length "
    "x.shape[-1]. A slice x[..., lo:lo + B] stops at the end of the row by itself, so the "
    "shorter last block needs nothing special: for s = 37 and B = 8 there are five blocks, the "
    "last one of 5.",
    "after the loop, (m, d) is the state of the whole row, and every output of every block "
    "uses that m and that d: y = e^(x − m) / d. m and d hold one value per row, so give them a "
    "last axis of length 1 ([..., None]) for x − m to subtract one m per row.",
)
MERGE_UNUSED_NUDGE = ("the checker passes its own merge as the argument merge, and counts the "
                      "calls: fold the blocks' states with that function (the parameter), not "
                      "with the library's blocked_online_softmax or merge_md.")
BROADCAST_NUDGE = ("m and d hold one value per row, shape x.shape[:-1]; x has one more axis. "
                   "Index them with [..., None] so that x − m subtracts each row's m from that "
                   "row.")
FULLY_MASKED_NUDGE = ("a fully masked row has no softmax: its state stays (−∞, 0) and the "
                      "output is e^(−∞ − (−∞)) / 0, NaN, as torch.softmax gives (the lesson's "
                      "convention). Leave the output pass unguarded: nothing to write for it.")


class MergeUnused(Exception):
    """The student's blocked_softmax never called the merge it was given."""


LSE_HINTS = (
    "log Σ e^x overflows once one e^x does. Pull the row maximum out before exponentiating "
    "and put it back after the log, as lesson 01b, section 4 does.",
    "np.max(x, axis=-1, keepdims=True) keeps the row axis, so that x − m broadcasts one maximum "
    "per row. The result has one value per row: shape x.shape[:-1], the kept axis dropped.",
    "a fully masked row has m = −∞, and x − m is then −∞ − (−∞) = NaN. Where m is −∞, subtract "
    "0 instead: the sum is 0 and log 0 = −∞, the right answer.",
)
SHAPE_NUDGE = ("the output needs one value per row, shape x.shape[:-1]. keepdims=True is right "
               "for x − m, but drop that axis from the result (index [..., 0], or a sum "
               "without keepdims).")


def _describe_state(args) -> str:
    masked = any(np.any(np.isneginf(a)) for a in args)
    parts = ", ".join(f"array of {np.size(a)}" if np.ndim(a) else f"{a}" for a in args)
    return ("masked entries (−∞): " if masked else "") + parts


def _update_cases():
    rng = np.random.default_rng(1)
    m = rng.standard_normal(6)
    return [(1.0, 1.0, 3.0),                                 # the maximum grows: rescale
            (2.0, 1.5, -1.0),                                # it does not
            (0.5, 2.0, 0.5),                                 # a tie
            (m, rng.uniform(0.5, 3.0, 6), m + 2 * rng.standard_normal(6)),
            (NEG_INF, 0.0, 1.5),                             # first unmasked entry
            (NEG_INF, 0.0, NEG_INF),                         # a masked entry, nothing seen yet
            (np.array([NEG_INF, 0.3, NEG_INF]), np.array([0.0, 1.0, 0.0]),
             np.array([NEG_INF, NEG_INF, 2.0]))]


def _merge_cases():
    rng = np.random.default_rng(2)
    return [(1.0, 2.0, 3.0, 1.5), (3.0, 1.5, 1.0, 2.0), (0.0, 1.0, 0.0, 1.0),
            (rng.standard_normal(5), rng.uniform(0.5, 4.0, 5),
             rng.standard_normal(5), rng.uniform(0.5, 4.0, 5)),
            (NEG_INF, 0.0, 1.0, 2.5),                        # empty ⊕ something
            (NEG_INF, 0.0, NEG_INF, 0.0),                    # empty ⊕ empty: still empty
            (np.array([NEG_INF, 1.0]), np.array([0.0, 3.0]),
             np.array([NEG_INF, NEG_INF]), np.array([0.0, 0.0]))]


def _blocked_cases():
    rng = np.random.default_rng(4)
    masked = rng.standard_normal((4, 20)) * 3
    masked[0, :6] = NEG_INF                                  # the whole first block (B = 6)
    masked[1, [2, 7, 8, 15]] = NEG_INF                       # scattered
    masked[2, :14] = NEG_INF                                 # two blocks and a part of one
    masked[3, -1] = NEG_INF                                  # the last entry
    one_by_one = rng.standard_normal((2, 7)) * 3
    one_by_one[0, :3] = NEG_INF                              # three empty blocks first
    one_by_one[1, [1, 4]] = NEG_INF
    fully = rng.standard_normal((3, 9)) * 3
    fully[1] = NEG_INF                                       # a fully masked row: NaN
    fully[2, 4:] = NEG_INF
    far = rng.standard_normal((2, 10)) * 3 + [[800.0], [-800.0]]  # e^(x − 0) is inf, then 0
    return [(rng.standard_normal(12) * 3, 4, sm.merge_md),   # one row, B divides s
            (rng.standard_normal((4, 37)) * 3, 8, sm.merge_md),   # the last block of 5
            (rng.standard_normal((3, 10)) * 3, 1, sm.merge_md),   # B = 1: the online update
            (rng.standard_normal((3, 10)) * 3, 10, sm.merge_md),  # B = s: one block
            (rng.standard_normal((3, 10)) * 3, 64, sm.merge_md),  # B > s: one short block
            (masked, 6, sm.merge_md),
            (one_by_one, 1, sm.merge_md),
            (fully, 4, sm.merge_md),
            (far, 4, sm.merge_md)]


def _describe_blocked(args) -> str:
    x, B, _ = args
    s = x.shape[-1]
    rows = "one row" if x.ndim == 1 else f"{int(np.prod(x.shape[:-1]))} rows"
    n = -(-s // B)
    blocks = ("every element its own block" if B == 1 else
              "one block, shorter than B" if B > s else "one block" if B == s else
              f"{n} blocks, the last one of {s - (n - 1) * B}" if s % B else
              f"{n} blocks of {B}")
    what = f"x of shape {x.shape} ({rows} of {s}), B = {B}: {blocks}"
    neg = np.isneginf(x)
    if neg.all(axis=-1).any():
        what += "; masked entries (−∞), one row fully masked (its softmax is NaN)"
    elif neg[..., :B].all(axis=-1).any():
        what += "; masked entries (−∞), the whole first block of a row among them"
    elif neg.any():
        what += "; masked entries (−∞)"
    top = np.max(x, axis=-1)
    if ((top < -700) & (top > NEG_INF)).any():
        what += "; one row's logits all near −800, another's near +800"
    return what


def _lse_cases():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 7))
    x[0, :4] = NEG_INF                                       # partly masked
    x[1] = NEG_INF                                           # fully masked: −inf
    return [(rng.standard_normal(5),),                       # one row
            (rng.standard_normal((4, 9)),),                  # several rows
            (rng.standard_normal((2, 3, 6)) * 1000,),        # e^x overflows even in float64
            (x,),
            (rng.standard_normal((2, 5)) + [[800.0], [-800.0]],)]  # rows 1600 apart


def _lse_global_max(x):
    m = np.max(x)  # no axis: the largest entry of every row, and e^(x − m) underflows elsewhere
    return m + np.log(np.sum(np.exp(x - m), axis=-1))


def _describe_lse(args) -> str:
    (x,) = args
    what = "rows with −∞ entries, one fully masked" if np.isneginf(x).any() else \
        "two rows 1600 apart (one near +800, one near −800)" if x.ndim == 2 and \
        np.ptp(x.mean(-1)) > 1000 else \
        "logits of size 1000: e^x overflows" if np.abs(x).max() > 100 else "ordinary logits"
    return f"x of shape {x.shape}, {what}"


def check_online_update(student, show: bool = True) -> Result:
    """``student(m, d, x) -> (m_new, d_new)``, against ``course_lib.softmax.online_update``."""
    with np.errstate(all="ignore"):  # an unguarded attempt makes NaN: reported, not warned
        return check("online_update", student, sm.online_update, _update_cases(),
                     hints=UPDATE_HINTS, rtol=1e-9, atol=1e-12, show=show,
                     describe=_describe_state,
                     nudges={"NaN": MASK_NUDGE, "truth value": ARRAY_NUDGE})


def check_merge(student, show: bool = True) -> Result:
    """``student(m1, d1, m2, d2) -> (m, d)``, against ``course_lib.softmax.merge_md``."""
    with np.errstate(all="ignore"):
        return check("merge", student, sm.merge_md, _merge_cases(), hints=MERGE_HINTS,
                     rtol=1e-9, atol=1e-12, show=show, describe=_describe_state,
                     nudges={"NaN": MASK_NUDGE, "truth value": ARRAY_NUDGE})


def _blocked_spec(x, B, merge):
    return sm.blocked_online_softmax(x, B)


def check_blocked_softmax(student, show: bool = True) -> Result:
    """``student(x, B, merge) -> softmax(x)`` over the last axis, against
    ``softmax.blocked_online_softmax``. The checker passes the library's merge (the student's
    own is exercise 2's), counting its calls: a loop that never calls it is refused."""
    def run(x, B, merge):
        calls = []

        def counted(*args):
            calls.append(1)
            return merge(*args)

        y = student(x, B, counted)
        n_blocks = -(-x.shape[-1] // B)
        if y is not None and not calls and n_blocks > 1:
            raise MergeUnused(f"your function never called the merge it was given ({n_blocks} "
                              "blocks, 0 merges)")
        return y

    with np.errstate(all="ignore"):  # a fully masked row is 0/0 = NaN, by the convention
        result = check("blocked_softmax", run, _blocked_spec, _blocked_cases(),
                       hints=BLOCKED_HINTS, rtol=1e-9, atol=1e-12, show=False,
                       describe=_describe_blocked,
                       nudges={"never called the merge": MERGE_UNUSED_NUDGE,
                               "could not be broadcast": BROADCAST_NUDGE,
                               "expected nan": FULLY_MASKED_NUDGE})
        loop = _loop_diagnosis(student) if result.status == "wrong" else None
    if loop:  # the blocks the loop merged tell its range apart where the outputs cannot
        result = Result("blocked_softmax", False, result.message.split("\n  Diagnosis:")[0]
                        .split("\n  Nudge:")[0] + f"\n  Diagnosis: {loop} "
                        "More: hint('blocked_softmax').")
    return _report(result, show)


def _blocks_merged(student, s: int, B: int):
    """Which blocks of a row of ``s`` (``B`` at a time) the student's loop folded in: the block
    states that its calls of the merge received, and how many blocks the row has. None when
    the loop raises."""
    x = np.random.default_rng(7).standard_normal((2, s)) * 3
    states = [sm.tile_md(x[..., lo:lo + B]) for lo in range(0, s, B)]
    seen = set()

    def recording(m1, d1, m2, d2):
        for k, (m_b, d_b) in enumerate(states):
            for m, d in ((m1, d1), (m2, d2)):
                if np.shape(m) == m_b.shape and np.allclose(m, m_b, rtol=1e-12) and \
                        np.allclose(d, d_b, rtol=1e-12):
                    seen.add(k)
        return sm.merge_md(m1, d1, m2, d2)

    try:
        student(x, B, recording)
    except Exception:  # the check's own message says what raised
        return None
    return sorted(seen), len(states)


def _loop_diagnosis(student) -> str | None:
    """The loop's range, from the blocks it merges on a row that B divides and on one it does
    not: on the second, the two loop mistakes give the same outputs, so only the blocks they
    merge tell them apart."""
    whole, ragged = _blocks_merged(student, 12, 4), _blocks_merged(student, 37, 8)
    if whole is None or ragged is None:
        return None
    (w_seen, w_n), (r_seen, r_n) = whole, ragged

    def of(seen, n):
        return f"all {n} blocks" if len(seen) == n else f"{len(seen)} of its {n} blocks"

    merged = (f"on a row of 12 with B = 4 it merged {of(w_seen, w_n)}; on a row of 37 with "
              f"B = 8, {of(r_seen, r_n)} (the last one has {37 % 8} elements)")
    if w_seen == list(range(w_n)) and r_seen == list(range(r_n - 1)):
        return (f"your loop merges every whole block but never the shorter last one: {merged}. "
                "A loop over the s // B whole blocks does that; the last s % B elements count "
                "too.")
    if w_seen == list(range(w_n - 1)) and r_seen == list(range(r_n - 1)):
        return (f"your loop stops one block early, whole or short: {merged}. The last block "
                "starts below the row length s, so the loop must go on while the start is "
                "below s, not below s − B.")
    return None


def check_logsumexp(student, show: bool = True) -> Result:
    """``student(x) -> log Σ e^x`` over the last axis, against ``softmax.logsumexp``."""
    with np.errstate(all="ignore"):  # a naive attempt overflows: that is reported, not warned
        return check("logsumexp", student, sm.logsumexp, _lse_cases(), hints=LSE_HINTS,
                     rtol=1e-9, atol=1e-12, show=show, describe=_describe_lse,
                     nudges={"your output has shape": SHAPE_NUDGE, "NaN": LSE_HINTS[2]})


register(Exercise(
    name="online_update", lesson="01_softmax", kind="python",
    writes="the online softmax update (m, d, x) -> (m_new, d_new), masked entries included",
    lines=3, check=check_online_update, solution=_online_update_solution, stub=online_update,
    mistakes=(Mistake("no rescale of the old sum", _update_no_rescale, "values differ"),
              Mistake("the rescale inverted, e^(m_new − m)", _update_rescale_inverted,
                      "values differ"),
              Mistake("no guard for −∞ − (−∞)", _update_unguarded, "NaN"),
              Mistake("Python's max on arrays", _update_python_max, "truth value")),
    hints=UPDATE_HINTS))

register(Exercise(
    name="merge", lesson="01_softmax", kind="python",
    writes="the merge ⊕ of two (m, d) states, empty states included", lines=3,
    check=check_merge, solution=_merge_solution, stub=merge,
    mistakes=(Mistake("only one side rescaled", _merge_one_side, "values differ"),
              Mistake("no guard: empty ⊕ empty", _merge_unguarded, "NaN"),
              Mistake("Python's max on arrays", _merge_python_max, "truth value")),
    hints=MERGE_HINTS))

register(Exercise(
    name="blocked_softmax", lesson="01_softmax", kind="python",
    writes="blocked online softmax: each block's (m, d) from tile_md, folded with a given "
           "merge from the empty state, then the output pass", lines=6,
    check=check_blocked_softmax, solution=_blocked_softmax_solution, stub=blocked_softmax,
    mistakes=(Mistake("the shorter last block dropped: only the s // B whole blocks merged",
                      _blocked_ragged_dropped, "never the shorter last one"),
              # on a row that B does not divide the two loops give the same outputs; the
              # blocks they merge (_loop_diagnosis) tell them apart
              Mistake("the loop stops a block early, range(0, s − B, B): the last block is "
                      "never merged, whole or short", _blocked_stops_early,
                      "stops one block early"),
              Mistake("the row length taken from len(x), which is the number of rows of a "
                      "2-D x", _blocked_rows_for_length, "4 rows of 37"),
              Mistake("each block normalised by its own (m, d), not by the merged state of "
                      "the row", _blocked_own_d, "values differ"),
              Mistake("the last block's m in the output pass, where the merged m belongs",
                      _blocked_last_m, "values differ"),
              Mistake("the fold started from (0, 0), not from the empty state (−∞, 0): when "
                      "every logit is far below 0, m stays 0 and e^(x − 0) underflows to 0",
                      _blocked_zero_state, "near −800"),
              Mistake("m and d used without a last axis: x − m cannot subtract one m per "
                      "row", _blocked_not_broadcast, "could not be broadcast"),
              Mistake("the merge it was given never called (the library's "
                      "blocked_online_softmax)", _blocked_library, "never called the merge")),
    hints=BLOCKED_HINTS))

register(Exercise(
    name="logsumexp", lesson="01b_softmax_numerics", kind="python",
    writes="a stable log-sum-exp over the last axis, −∞ for a fully masked row", lines=4,
    check=check_logsumexp, solution=_logsumexp_solution, stub=logsumexp,
    mistakes=(Mistake("naive log Σ e^x", _lse_naive, "values differ"),
              Mistake("the kept axis left on the result", _lse_keepdims, "your output has shape"),
              Mistake("no guard for a fully masked row", _lse_unguarded, "NaN"),
              Mistake("the maximum not added back", _lse_max_not_added_back, "values differ"),
              Mistake("one max for the whole array, not one per row", _lse_global_max,
                      "values differ")),
    hints=LSE_HINTS))


# --- the think-question of lesson 01 -----------------------------------------------------------
def _blocked_flops(s: int, block: int) -> int:
    """The measured FLOPs of ``blocked`` on an s × s input (lesson 01, section 9's formula)."""
    return 7 * s * s + (6 * -(-s // block) - 8) * s


register(Question(
    name="q01_best_block", lesson="01_softmax",
    asks="For which block size B does blocked online softmax do the fewest FLOPs on a row of "
         "length s, and why would a GPU kernel still not pick it?",
    answer=(
        "The measured count on an s × s input is 7s² + (6⌈s/B⌉ − 8)s: the merges cost "
        "6 FLOPs per block and row, so the fewer blocks the better. It is smallest when "
        "⌈s/B⌉ = 1, i.e. B ≥ s: one block per row, 7s² − 2s, exactly safe softmax "
        f"(s = 256: {_blocked_flops(256, 256):,} FLOPs against {_blocked_flops(256, 16):,} "
        "with B = 16).\n\n"
        "But a block is what a kernel holds on chip while it works on it: B = s means the whole "
        "row in registers or shared memory (the 'footprint' column of section 9: 16 for "
        "B = 16, s for fused). For attention rows of thousands to a million keys that does not "
        "fit. The merges are cheap by comparison: 6 FLOPs per block and row, "
        f"{_blocked_flops(256, 16) / _blocked_flops(256, 256) - 1:.0%} more work at s = 256 "
        "with B = 16, and no extra memory traffic (3 accesses per element either way). So a "
        "kernel picks the largest B that fits on chip (64 or 128 keys in the course's "
        "FlashAttention kernels on a GPU: PORTABLE_CONFIGS in course_lib/kernels/flash_v2.py) and "
        "pays for the merges.")))
