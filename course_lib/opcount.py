"""Count FLOPs and memory accesses by running an algorithm on instrumented arrays.

Introduced in notebooks/01_softmax.ipynb, which uses it to count the softmax variants of
``course_lib.softmax``; nothing here knows a formula: the counts come from running the code.

How it works: ``count(fn, x)`` wraps the input ``x`` in a :class:`Tracked` array that lives in
*memory* (global memory, HBM) and calls ``fn`` on it. Every NumPy operation on a Tracked array
goes through ``__array_ufunc__`` / ``__array_function__`` and is tallied; its result is a Tracked
array *on chip* (registers, shared memory), which is free to use again.

The counting convention (the lesson states it; change it here and every table follows):

* **Memory model**: a kernel with one thread (or thread block) per row. ``x`` and the output
  ``y = np.empty_like(x)`` live in memory; everything an algorithm computes from them lives on
  chip. Taking elements out of a memory array (``x[..., j]``, ``x[..., lo:hi]``, or passing it
  to a ufunc) is one **read** per element; storing into one (``y[..., j] = ...``) is one
  **write** per element. Using an on-chip value again costs nothing; reading ``x`` again in a
  later pass costs again.
* **FLOPs**: one per scalar ``exp``, ``add``, ``sub``, ``mul``, ``div`` and ``max``
  (an elementwise op on n outputs is n FLOPs; reducing n numbers is n - 1).
  ``log`` is counted as its own kind too.
* **Guards** (``cmp``: a comparison such as ``m == -inf``; ``select``: ``np.where``) handle
  masked entries. They are counted but are not FLOPs.
* **On-chip footprint**: the largest on-chip array an algorithm creates, per row (1 for a
  streaming loop, B for a tile of B elements, s for a whole row held on chip).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

#: ufunc -> kind of operation. A ufunc not listed here raises, so nothing goes uncounted.
UFUNC_KINDS = {
    np.exp: "exp", np.log: "log", np.add: "add", np.subtract: "sub", np.multiply: "mul",
    np.true_divide: "div", np.maximum: "max", np.equal: "cmp",
}
FLOP_KINDS = ("exp", "add", "sub", "mul", "div", "max")
GUARD_KINDS = ("cmp", "select")


@dataclass
class Counts:
    """What one run did: operations by kind, memory reads and writes, on-chip footprint."""

    rows: int                 # rows of the input (product of the leading dimensions)
    length: int               # s, the length of the last axis
    ops: Counter = field(default_factory=Counter)
    reads: int = 0
    writes: int = 0
    footprint: int = 0        # largest on-chip array, in elements per row

    def flops(self, weights: dict | None = None) -> int:
        """Σ weight·count over the FLOP kinds (every weight 1 unless ``weights`` says otherwise)."""
        weights = weights or {}
        return sum(weights.get(k, 1) * self.ops[k] for k in FLOP_KINDS)

    @property
    def accesses(self) -> int:
        return self.reads + self.writes

    def per_element(self, value: int) -> float:
        """``value`` divided by the number of input elements (rows · s)."""
        return value / (self.rows * self.length)

    def as_dict(self) -> dict:
        return {**{k: self.ops[k] for k in FLOP_KINDS + ("log",) + GUARD_KINDS},
                "flops": self.flops(), "reads": self.reads, "writes": self.writes,
                "accesses": self.accesses, "footprint": self.footprint}

    def _saw(self, data) -> None:
        if self.rows:
            self.footprint = max(self.footprint, math.ceil(np.size(data) / self.rows))


class Tracked(NDArrayOperatorsMixin):
    """A NumPy array that tallies what is done to it into a shared :class:`Counts`.

    ``in_memory=True`` for arrays in global memory (the input and the output), False for
    arrays on chip (everything computed). Supports what ``course_lib.softmax`` uses: indexing,
    arithmetic, the ufuncs of ``UFUNC_KINDS``, ``np.max``, ``np.sum``, ``np.where``,
    ``np.stack`` and the ``*_like`` constructors. Anything else raises ``TypeError``.
    """

    __slots__ = ("data", "counts", "in_memory")

    def __init__(self, data, counts: Counts, in_memory: bool = False):
        self.data = np.asarray(data)
        self.counts = counts
        self.in_memory = in_memory
        if not in_memory:
            counts._saw(self.data)

    # -- array attributes
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        where = "memory" if self.in_memory else "on chip"
        return f"Tracked({where}, shape={self.shape}, dtype={self.dtype})"

    def __array__(self, dtype=None, copy=None):
        raise TypeError("a Tracked array cannot be converted silently: that would skip the count "
                        "(use .data to look at the values)")

    # -- memory traffic
    def _take(self):
        """The raw values of an operand; one read per element if it lives in memory."""
        if self.in_memory:
            self.counts.reads += self.data.size
        return self.data

    def __getitem__(self, key):
        part = self.data[key]
        if self.in_memory:
            self.counts.reads += np.size(part)
        return Tracked(part, self.counts)

    def __setitem__(self, key, value):
        if self.in_memory:
            self.counts.writes += np.size(self.data[key])
        self.data[key] = _unwrap(value)

    # -- arithmetic
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            raise TypeError("Tracked arrays do not support out=")
        kind = UFUNC_KINDS.get(ufunc)
        if kind is None or method not in ("__call__", "reduce"):
            raise TypeError(f"opcount does not know how to count np.{ufunc.__name__}.{method}")
        raw = [_unwrap(a) for a in inputs]
        result = getattr(ufunc, method)(*raw, **kwargs)
        if method == "reduce":  # reducing n numbers to one costs n - 1
            self.counts.ops[kind] += np.size(raw[0]) - np.size(result)
        else:
            self.counts.ops[kind] += np.size(result)
        return Tracked(result, self.counts)

    def __array_function__(self, func, types, args, kwargs):
        handler = _FUNCTIONS.get(func)
        if handler is None:
            raise TypeError(f"opcount does not know how to count np.{func.__name__}")
        return handler(self.counts, *args, **kwargs)


def _unwrap(a):
    """Raw values of a Tracked operand (counting its reads if in memory), or ``a`` unchanged."""
    if isinstance(a, Tracked):
        return a._take()
    if isinstance(a, (list, tuple)):
        return type(a)(_unwrap(b) for b in a)
    return a


def _reduction(kind, np_func):
    def handler(counts, a, *args, **kwargs):
        raw = _unwrap(a)
        result = np_func(raw, *args, **kwargs)
        counts.ops[kind] += np.size(raw) - np.size(result)
        return Tracked(result, counts)
    return handler


def _where(counts, cond, a, b):
    result = np.where(*(_unwrap(v) for v in (cond, a, b)))
    counts.ops["select"] += np.size(result)
    return Tracked(result, counts)


def _stack(counts, arrays, *args, **kwargs):  # gathering on-chip values: free
    return Tracked(np.stack([_unwrap(a) for a in arrays], *args, **kwargs), counts)


def _like(np_func):
    def handler(counts, a, *args, **kwargs):  # allocation: no traffic, no FLOPs
        base = a.data if isinstance(a, Tracked) else a
        in_memory = isinstance(a, Tracked) and a.in_memory and np_func is np.empty_like
        return Tracked(np_func(base, *args, **kwargs), counts, in_memory=in_memory)
    return handler


_FUNCTIONS = {
    np.max: _reduction("max", np.max), np.amax: _reduction("max", np.amax),
    np.sum: _reduction("add", np.sum), np.where: _where, np.stack: _stack,
    np.empty_like: _like(np.empty_like), np.ones_like: _like(np.ones_like),
    np.zeros_like: _like(np.zeros_like), np.full_like: _like(np.full_like),
}


def count(fn, x, *args, must_store: bool = True, **kwargs) -> tuple[Counts, np.ndarray]:
    """Run ``fn(x, *args, **kwargs)`` on an instrumented copy of ``x``; return (counts, result).

    ``fn`` must write its result into memory (``y = np.empty_like(x)``; ``y[...] = ...``) so
    that the writes are counted; a result computed on chip and never stored is an error unless
    ``must_store=False`` (for one pass of an algorithm, such as ``max_pass``, or a tuple result
    such as ``online_md``'s (m, d), which stay on chip for the next pass).
    """
    x = np.array(x)                                       # a copy, never the caller's array
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension")
    counts = Counts(rows=int(np.prod(x.shape[:-1])), length=x.shape[-1])
    result = fn(Tracked(x, counts, in_memory=True), *args, **kwargs)
    if isinstance(result, tuple):
        return counts, tuple(_value(r) for r in result)
    if must_store and not (isinstance(result, Tracked) and result.in_memory):
        raise TypeError(f"{getattr(fn, '__name__', fn)} returned a value it never stored to "
                        "memory: write the output into np.empty_like(x)")
    return counts, _value(result)


def _value(r):
    return r.data if isinstance(r, Tracked) else np.asarray(r)
