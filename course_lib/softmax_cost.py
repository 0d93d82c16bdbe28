"""The measured cost of every softmax variant: FLOPs and memory accesses against the row length s.

Introduced in notebooks/01_softmax.ipynb. The counts come from ``course_lib.opcount`` running
the functions of ``course_lib.softmax`` on instrumented arrays (the convention is in opcount's
docstring). The closed forms below are *checked* against those counts, never used to make them.

The input is s×s, as in attention, where softmax runs over the N×N score matrix: s rows of
length s, so per-row costs are multiplied by s (hence the s² in every formula). The lesson's
appendix uses these counts to check FLOP formulas that circulate for the same algorithms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from course_lib import softmax as sm
from course_lib.opcount import FLOP_KINDS, Counts, count


@dataclass(frozen=True)
class Variant:
    name: str
    fn: Callable
    passes: str                 # how many times the algorithm reads x, in words
    per_row: Callable           # (s, n_blocks) -> dict of counts for one row of length s
    flops_label: str            # the FLOP closed form on an s×s input, as the lesson writes it


#: Per-row closed forms, s = row length, nb = number of blocks (⌈s/B⌉). Op kinds not listed
#: are 0. Checked against the measured counts by ``check_closed_forms`` and the tests.
VARIANTS = {
    "naive": Variant(
        "naive", sm.naive_softmax, "2 passes",
        lambda s, nb: dict(exp=2 * s, add=s - 1, div=s, reads=2 * s, writes=s),
        "4s² − s"),
    "safe": Variant(
        "safe", sm.safe_softmax, "3 passes",
        lambda s, nb: dict(max=s - 1, sub=2 * s, exp=2 * s, add=s - 1, div=s,
                           reads=3 * s, writes=s),
        "7s² − 2s"),
    "online": Variant(
        "online", sm.online_softmax, "2 passes",
        lambda s, nb: dict(max=s - 1, sub=3 * s - 2, exp=3 * s - 2, mul=s - 1, add=s - 1,
                           div=s, cmp=s - 1, select=s - 1, reads=2 * s, writes=s),
        "10s² − 7s"),
    "blocked": Variant(
        "blocked", sm.blocked_online_softmax, "2 passes",
        lambda s, nb: dict(max=s - 1, sub=2 * s + 2 * nb - 2, exp=2 * s + 2 * nb - 2,
                           mul=2 * nb - 2, add=s - 1, div=s, cmp=2 * nb - 1,
                           select=2 * nb - 1, reads=2 * s, writes=s),
        "7s² + (6⌈s/B⌉ − 8)s"),
    "fused": Variant(
        "fused", sm.fused_softmax, "1 pass, row on chip",
        lambda s, nb: dict(max=s - 1, sub=s, exp=s, add=s - 1, div=s, reads=s, writes=s),
        "5s² − 2s"),
}


def measure(name: str, s: int, rows: int | None = None, block_size: int = 16,
            seed: int = 0) -> Counts:
    """Count one variant on a fresh random (rows, s) input (rows=None: s×s)."""
    v = VARIANTS[name]
    x = np.random.default_rng(seed).standard_normal((s if rows is None else rows, s))
    args = (block_size,) if name == "blocked" else ()
    counts, y = count(v.fn, x, *args)
    np.testing.assert_allclose(y, sm.safe_softmax(x), rtol=1e-12, atol=1e-15)
    return counts


def expected(name: str, s: int, rows: int | None = None, block_size: int = 16) -> dict:
    """The closed form's counts for the whole (rows, s) input."""
    rows = s if rows is None else rows
    per_row = VARIANTS[name].per_row(s, math.ceil(s / block_size))
    return {k: rows * v for k, v in per_row.items()}


def check_closed_forms(name: str, s: int, rows: int | None = None,
                       block_size: int = 16) -> Counts:
    """Measure, then assert that every count equals its closed form; return the counts."""
    c = measure(name, s, rows, block_size)
    want = expected(name, s, rows, block_size)
    got = {**{k: c.ops[k] for k in c.ops}, "reads": c.reads, "writes": c.writes}
    for key in set(want) | {k for k, v in got.items() if v}:
        if got.get(key, 0) != want.get(key, 0):
            raise AssertionError(f"{name}, s={s}: measured {key} = {got.get(key, 0)}, "
                                 f"closed form gives {want.get(key, 0)}")
    return c


def flops_closed_form(name: str, s: int, block_size: int = 16) -> int:
    """The FLOP closed form on an s×s input (the sum of the FLOP kinds of ``expected``)."""
    want = expected(name, s, None, block_size)
    return sum(want.get(k, 0) for k in FLOP_KINDS)


def table(sizes=(1, 2, 4, 16, 64, 256), block_size: int = 16, names=None) -> list[dict]:
    """Measure every variant on s×s inputs; check closed forms; return one row per (variant, s)."""
    out = []
    for name in names or VARIANTS:
        for s in sizes:
            c = check_closed_forms(name, s, None, block_size)
            out.append({"variant": name, "s": s, **c.as_dict(),
                        "accesses_per_element": c.per_element(c.accesses),
                        "flops_per_element": c.per_element(c.flops())})
    return out


def print_table(rows: list[dict], block_size: int = 16) -> None:
    """Print FLOPs and accesses per element for each variant against s, with the closed forms."""
    sizes = sorted({r["s"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["variant"], r["s"]): r for r in rows}
    width = max(9, *(len(f"{by[n, s]['flops']:,}") + 1 for n in names for s in sizes))
    head = f"{'variant':<9}{'passes':<21}" + "".join(f"{'s=' + str(s):>{width}}" for s in sizes)

    print(f"FLOPs on an s×s input (exp, add, sub, mul, div, max each count 1; B = {block_size})")
    print(head + "   closed form (checked)")
    for n in names:
        v = VARIANTS[n]
        cells = "".join(f"{by[n, s]['flops']:>{width},}" for s in sizes)
        print(f"{n:<9}{v.passes:<21}{cells}   {v.flops_label}")
    print()
    print("memory accesses per element: (reads + writes) / s²")
    print(head + f"   reads + writes, largest on-chip array per row at s={sizes[-1]}")
    for n in names:
        v = VARIANTS[n]
        cells = "".join(f"{by[n, s]['accesses_per_element']:>{width}.2f}" for s in sizes)
        r = by[n, sizes[-1]]
        print(f"{n:<9}{v.passes:<21}{cells}   {r['reads'] // r['writes']} + 1, {r['footprint']}")


def pass_ledger(name: str, s: int) -> list[tuple[str, Counts]]:
    """Counts of each pass of ``safe`` or ``online`` softmax on an s×s input, pass by pass."""
    x = np.random.default_rng(0).standard_normal((s, s))
    if name == "safe":
        c1, m = count(sm.max_pass, x, must_store=False)
        c2, d = count(sm.sum_exp_pass, x, m, must_store=False)
        c3, _ = count(sm.output_pass, x, m, d)
        return [("pass 1: m = max x", c1), ("pass 2: d = Σ e^(x−m)", c2),
                ("pass 3: y = e^(x−m) / d", c3)]
    if name == "online":
        c1, (m, d) = count(sm.online_md, x, must_store=False)
        c2, _ = count(sm.output_pass, x, m, d)
        return [("pass 1: (m, d) online", c1), ("pass 2: y = e^(x−m) / d", c2)]
    raise ValueError(f"name must be 'safe' or 'online', got {name!r}")


def print_ledger(ledger: list[tuple[str, Counts]]) -> None:
    """Print a ``pass_ledger``: one line per pass, op counts by kind, reads and writes."""
    print(f"{'':<26}" + "".join(f"{k:>7}" for k in FLOP_KINDS)
          + f"{'FLOPs':>8}{'reads':>7}{'writes':>7}")
    for label, c in ledger:
        print(f"{label:<26}" + "".join(f"{c.ops[k]:>7}" for k in FLOP_KINDS)
              + f"{c.flops():>8}{c.reads:>7}{c.writes:>7}")
