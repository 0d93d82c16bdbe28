"""Exercises of notebooks/01_softmax.ipynb (the online update, the merge ⊕ of (m, d) states)
and notebooks/01b_softmax_numerics.ipynb (a stable log-sum-exp).

The specs are ``course_lib.softmax.online_update``, ``merge_md`` and ``logsumexp`` (the
reference solutions, tested in tests/test_softmax.py). Each checker first tries ordinary
inputs, then masked ones (-inf), with a hint for each stage.
"""
from __future__ import annotations

import numpy as np

from course_lib.exercises import Result, check
from course_lib.softmax import logsumexp, merge_md, online_update

NEG_INF = -np.inf

UPDATE_HINT = ("the new maximum is max(m, x) (np.maximum works on arrays); d was a sum of "
               "e^(x_j - m), so rescale it by e^(m - m_new), then add the new term e^(x - m_new); "
               "return the pair (m_new, d_new)")
MERGE_HINT = ("m = max(m1, m2); each part's sum was taken relative to its own maximum, so d1 "
              "is rescaled by e^(m1 - m) and d2 by e^(m2 - m); return the pair (m, d)")
LSE_HINT = ("subtract the row maximum m before exponentiating (np.max(x, axis=-1, "
            "keepdims=True)) and add it back after the log: m + log Σ e^(x - m)")
LSE_MASK_HINT = ("a row that is entirely -inf has m = -inf, and x - m is then NaN; its LSE is "
                 "log 0 = -inf. Subtract m_ref = np.where(m == -np.inf, 0.0, m) instead of m")
MASK_HINT = ("two -inf maxima meet: the new maximum is -inf and -inf - (-inf) = NaN. Subtract "
             "m_ref = np.where(m_new == -np.inf, 0.0, m_new) (m_new: the new maximum) instead: "
             "the exponentials become e^(-inf) = 0 and d stays 0")


def _update_cases(masked: bool):
    rng = np.random.default_rng(1)
    if masked:
        return [(NEG_INF, 0.0, 1.5),                        # first unmasked entry
                (NEG_INF, 0.0, NEG_INF),                    # a masked entry, nothing seen yet
                (np.array([NEG_INF, 0.3, NEG_INF]), np.array([0.0, 1.0, 0.0]),
                 np.array([NEG_INF, NEG_INF, 2.0]))]
    m = rng.standard_normal(6)
    return [(1.0, 1.0, 3.0),                                 # the maximum grows: rescale
            (2.0, 1.5, -1.0),                                # it does not
            (0.5, 2.0, 0.5),                                 # a tie
            (m, rng.uniform(0.5, 3.0, 6), m + 2 * rng.standard_normal(6))]


def _merge_cases(masked: bool):
    rng = np.random.default_rng(2)
    if masked:
        return [(NEG_INF, 0.0, 1.0, 2.5),                   # empty ⊕ something
                (NEG_INF, 0.0, NEG_INF, 0.0),               # empty ⊕ empty: still empty
                (np.array([NEG_INF, 1.0]), np.array([0.0, 3.0]),
                 np.array([NEG_INF, NEG_INF]), np.array([0.0, 0.0]))]
    return [(1.0, 2.0, 3.0, 1.5), (3.0, 1.5, 1.0, 2.0), (0.0, 1.0, 0.0, 1.0),
            (rng.standard_normal(5), rng.uniform(0.5, 4.0, 5),
             rng.standard_normal(5), rng.uniform(0.5, 4.0, 5))]


def _lse_cases(masked: bool):
    rng = np.random.default_rng(3)
    if masked:
        x = rng.standard_normal((3, 7))
        x[0, :4] = NEG_INF                                  # partly masked
        x[1] = NEG_INF                                      # fully masked: -inf
        return [(x,)]
    return [(rng.standard_normal(5),),                       # one row
            (rng.standard_normal((4, 9)),),                  # several rows
            (rng.standard_normal((2, 3, 6)) * 1000,)]        # e^x overflows even in float64


def _two_stages(name, student, spec, cases, hint, mask_hint=MASK_HINT) -> Result:
    result = check(name, student, spec, cases(False), hint=hint, rtol=1e-9, atol=1e-12)
    if not result:
        return result
    return check(f"{name}, masked entries", student, spec, cases(True), hint=mask_hint,
                 rtol=1e-9, atol=1e-12)


def check_online_update(student) -> Result:
    """Check ``student(m, d, x) -> (m_new, d_new)`` against ``course_lib.softmax.online_update``."""
    return _two_stages("online update", student, online_update, _update_cases, UPDATE_HINT)


def check_merge(student) -> Result:
    """Check ``student(m1, d1, m2, d2) -> (m, d)`` against ``course_lib.softmax.merge_md``."""
    return _two_stages("merge", student, merge_md, _merge_cases, MERGE_HINT)


def check_logsumexp(student) -> Result:
    """Check ``student(x) -> log Σ e^x`` over the last axis against ``softmax.logsumexp``."""
    with np.errstate(all="ignore"):  # a naive attempt overflows: that is reported, not warned
        return _two_stages("logsumexp", student, logsumexp, _lse_cases, LSE_HINT, LSE_MASK_HINT)
