"""Exercises of notebooks/01_softmax.ipynb (the online update, the merge ⊕ of (m, d) states)
and notebooks/01b_softmax_numerics.ipynb (a stable log-sum-exp), and the think-question of 01.

The specs are ``course_lib.softmax.online_update``, ``merge_md`` and ``logsumexp`` (tested in
tests/test_softmax.py). Each checker runs ordinary inputs first, then masked ones (−∞ entries,
rows that are masked so far or entirely), and picks its nudge by what went wrong: a NaN from
−∞ − (−∞), Python's ``max`` on arrays, an output with a kept axis.
"""
from __future__ import annotations

import numpy as np

from course_lib import softmax as sm
from course_lib.exercises import Exercise, Mistake, Question, Result, check, register

NEG_INF = -np.inf


# --- what the notebooks show (tests/test_exercises.py checks the notebooks have this text) ---
def online_update(m, d, x):
    # TODO: the new maximum, then the rescaled old sum plus the new term
    raise NotImplementedError


def merge(m1, d1, m2, d2):
    # TODO: return (m, d), the state of both parts together
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
        "kernel picks the largest B that fits on chip (64 or 128 keys in FlashAttention) and "
        "pays for the merges.")))
