"""Predict, then measure: a student writes down a number before the lesson reveals it.

Introduced in notebooks/00_setup.ipynb; every lesson uses it before a count, a byte total, a
time or a ratio appears. Two calls, in two cells:

    predict("hbm_reads", 2 * N * d)        # your guess, before the cell that computes it
    ...
    reveal("hbm_reads", measured)          # the number, and how far the guess was

``reveal`` scores the guess by the ratio between guess and value (the order of magnitude is
what a model of the machine gets right or wrong): within 10 % "spot on", within 2× "the right
size", else off by that factor, said which way. A reveal with no prediction (the notebook run
top to bottom as it ships, as CI runs it) prints the value and asks for a guess next time; it
never fails. ``scoreboard()`` lists the lesson's predictions so far.
"""
from __future__ import annotations

import math

_GUESSES: dict[str, float] = {}
_SCORES: dict[str, tuple[float, float, str]] = {}

SPOT_ON = 1.10  # a guess within 10 % of the value
RIGHT_SIZE = 2.0  # a guess within a factor of 2


def predict(name: str, guess) -> None:
    """Record a guess for ``name`` (a number; ``None`` or ``...``: not made yet)."""
    if guess is None or guess is Ellipsis:
        print(f"{name}: no prediction yet. Replace the None/... with your guess, then run on.")
        return
    try:
        value = float(guess)
    except (TypeError, ValueError):
        raise TypeError(f"predict({name!r}, ...) takes a number, got {guess!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"predict({name!r}, ...) takes a finite number, got {guess!r}")
    _GUESSES[name] = value
    print(f"{name}: your prediction {value:.4g} is recorded. The lesson reveals it below.")


def score(guess: float, value: float) -> str:
    """How far ``guess`` is from ``value``, in words ("spot on", "the right size", "8.0× too
    high", ...). Both of one sign; zero is compared by the absolute difference."""
    if value == 0 or guess == 0:
        return "spot on" if guess == value else f"off by {abs(guess - value):.3g}"
    if (guess > 0) != (value > 0):
        return "the wrong sign"
    ratio = guess / value
    far = max(ratio, 1 / ratio)
    if far <= SPOT_ON:
        return "spot on"
    if far <= RIGHT_SIZE:
        return f"the right size ({'high' if ratio > 1 else 'low'} by {far:.2f}×)"
    return f"{far:.1f}× too {'high' if ratio > 1 else 'low'}"


def reveal(name: str, value, unit: str = "") -> str:
    """Print ``value`` beside the guess recorded for ``name`` and return the verdict."""
    value = float(value)
    shown = f"{value:.4g}{(' ' + unit) if unit else ''}"
    if name not in _GUESSES:
        print(f"{name} = {shown}. (No prediction was recorded: next time, guess first.)")
        return "no prediction"
    guess = _GUESSES[name]
    verdict = score(guess, value)
    _SCORES[name] = (guess, value, verdict)
    print(f"{name} = {shown}; you predicted {guess:.4g}: {verdict}.")
    return verdict


def scoreboard() -> dict[str, tuple[float, float, str]]:
    """Every prediction revealed so far: {name: (guess, value, verdict)}, printed as a table."""
    if not _SCORES:
        print("No prediction revealed yet.")
    for name, (guess, value, verdict) in _SCORES.items():
        print(f"{name:<28} guess {guess:<12.4g} value {value:<12.4g} {verdict}")
    return dict(_SCORES)
