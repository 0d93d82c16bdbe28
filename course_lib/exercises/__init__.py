"""Exercise checkers: a spec, a student's function, one ``check(...)`` call.

Introduced in notebooks/00_setup.ipynb. Reference solutions live beside the checkers in
``course_lib.exercises.<lesson>`` and are tested; the notebooks do not show them.

An unfinished exercise (the stub raises ``NotImplementedError`` or returns ``None``) prints a
hint and returns False instead of raising, so a notebook still runs top to bottom.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class Result:
    """What a checker found; truthy when the exercise is solved."""

    name: str
    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"{self.name}: {'passed' if self.passed else 'not yet'}"


def _as_array(x):
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(x, tuple):
        return tuple(_as_array(y) for y in x)
    return np.asarray(x, dtype=np.float64)


def _compare(got, want, rtol, atol) -> str | None:
    """None if equal within tolerance, else a description of where they differ."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"expected a tuple of {len(want)} values, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            why = _compare(g, w, rtol, atol)
            if why:
                return f"item {i}: {why}"
        return None
    if np.shape(got) != np.shape(want):
        return f"shape {np.shape(got)} but expected {np.shape(want)}"
    close = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if close.all():
        return None
    idx = tuple(int(i) for i in np.argwhere(~close)[0])
    return (f"{int((~close).sum())} of {close.size} values differ; first at index {idx}: "
            f"got {np.asarray(got)[idx]!r}, expected {np.asarray(want)[idx]!r}")


def check(name: str, student: Callable, spec: Callable, cases, hint: str,
          rtol: float = 1e-6, atol: float = 1e-9, show: bool = True) -> Result:
    """Run ``student(*args)`` and ``spec(*args)`` on every case and compare.

    ``cases`` is a list of argument tuples (seeded by the caller, so failures reproduce).
    """
    for n, args in enumerate(cases):
        try:
            got = student(*args)
        except NotImplementedError:
            return _report(Result(name, False, f"not written yet. Hint: {hint}"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            why = f"case {n} raised {type(exc).__name__}: {exc}. Hint: {hint}"
            return _report(Result(name, False, why), show)
        if got is None:
            return _report(Result(name, False, f"returned None (unfinished?). Hint: {hint}"), show)
        want = spec(*args)
        why = _compare(_as_array(got), _as_array(want), rtol, atol)
        if why:
            why = f"case {n} ({_describe(args)}): {why}. Hint: {hint}"
            return _report(Result(name, False, why), show)
    return _report(Result(name, True, f"all {len(cases)} cases match"), show)


def _describe(args) -> str:
    parts = []
    for a in args:
        shape = getattr(a, "shape", None)
        parts.append(f"shape {tuple(shape)}" if shape is not None else repr(a))
    return ", ".join(parts)


def _report(result: Result, show: bool) -> Result:
    if show:
        mark = "✓" if result.passed else "✗"
        print(f"{mark} {result.name}: {result.message}")
    return result
