"""Diagnosing a wrong answer: the registered mistake it looks like, in words.

Introduced with notebooks/11_kv_cache_gqa.ipynb; used by the exercises of lessons 11 to 13.

A checker first runs the cases as ``check`` or ``check_kernel`` do, without hints. On a wrong
attempt, ``diagnosed`` asks the exercise's ``diagnose(message)`` what the answer looks like: it
compares the student's outputs with what each classic mistake would give (a factor off, a
base-2 log-sum-exp, keys past the end with a weight, block and slot swapped) and returns the
explanation of the one that matches, or None. The message then says what went wrong and what it
looks like; without a diagnosis it gives the nudge of the hint ladder.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from course_lib.exercises import Result, _nudge, _report


def diagnosed(name: str, result: Result, diagnose: Callable[[str], str | None], hints,
              nudges=None, show: bool = True) -> Result:
    """``result`` of a check run without hints, with the diagnosis of a wrong attempt and its
    nudge (``nudges``: {text in the message: nudge}, else the first hint)."""
    if result.status != "wrong" or "this exercise asks for" in result.message:
        return _report(result, show)
    what = diagnose(result.message)
    if what:  # the diagnosis is the nudge; the ladder goes on from its first rung
        message = f"{result.message}\n  What it looks like: {what} More: hint('{name}')."
    else:
        message = result.message + _nudge(name, hints, result.message, nudges)
    return _report(Result(name, False, message), show)


def same(got, want, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Equal within tolerance, NaN where NaN and inf where inf (a signature's test)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return got.shape == want.shape and bool(
        np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True).all())
