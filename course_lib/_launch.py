"""Launch a Triton kernel again for a fraction of Triton's host time.

``kernel[grid](*args, **kwargs)`` does a lot of work on the CPU before the GPU sees anything:
it binds the arguments, computes their *specialization* (each tensor's dtype and whether its
address is 16-byte aligned, each integer's value class: 1, a multiple of 16, or other), looks up
the compiled kernel for it, checks that no global the kernel reads has changed, builds launch
metadata, and only then calls the compiled launcher. For a decode step whose GPU time is a few
tens of µs, that host work decides the step's time (lesson 12, section 8, measures it:
course_lib/data/dropin.json, ``host``).

``launch(kernel, grid, *args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does. The
first call for a given key goes through Triton (which compiles if needed) and keeps the compiled
kernel; later calls with the same key call its launcher directly. The key holds everything
Triton's specialization depends on, conservatively: the kernel, the device, every tensor's dtype
and 16-byte alignment, every other argument's value (integers by value, so a new stride or
length takes the slow path once), and the keyword arguments (constexprs, num_warps, num_stages).
The fast path is skipped, and Triton does everything, in the interpreter, when a launch hook is
installed (a profiler), when the grid is a callable, and with a Triton version whose launcher
interface has not been checked on a GPU against the slow path (``TESTED_TRITON``: the launcher's
arguments are internal to Triton and change between versions; ``FAST`` is then False).
"""
from __future__ import annotations

import collections
import inspect

import torch
import triton
from triton import knobs as _knobs
from triton.runtime.driver import driver as _driver

from course_lib._device import INTERPRET

# Versions whose CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *args) was checked on an H100 (tests/test_ops.py's
# GPU test compares the fast path with Triton's own launch, output for output).
TESTED_TRITON = ("3.6",)
_MAX_ENTRIES = 512
_CACHE: collections.OrderedDict = collections.OrderedDict()
FAST = not INTERPRET and triton.__version__.rsplit(".", 1)[0] in TESTED_TRITON
SLOW_LAUNCHES = 0  # launches that went through Triton's own path (the tests read it)


def _specialization(args) -> list:
    # a list comprehension: the cheapest loop Python has (this runs on every launch)
    return [(a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
            else (float if type(a) is float else a) for a in args]


def _tail(kernel, n_positional: int, kwargs: dict) -> tuple:
    """The values of the parameters after the positional ones, in the kernel's order: what the
    compiled launcher takes after them (constexprs included; it skips them itself)."""
    out = []
    for p in kernel.params[n_positional:]:
        if p.name in kwargs:
            out.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise TypeError(f"{kernel.__name__}: missing argument {p.name!r}")
    return tuple(out)


def _hooks_installed() -> bool:
    """Whether a profiler hooked Triton's launches (then Triton launches, and calls them).
    Triton 3.5+ keeps the hooks in a ``HookChain``, never None: what counts is its ``calls``."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter is not None)
                or getattr(leave, "calls", leave is not None))


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, with Triton's per-call host work done once per key."""
    global FAST, SLOW_LAUNCHES
    if not FAST or callable(grid):
        return kernel[grid](*args, **kwargs)
    driver = _driver.active
    device = driver.get_current_device()
    key = (kernel, device, *_specialization(args), *kwargs.items())
    entry = _CACHE.get(key)
    if entry is None or _hooks_installed():
        SLOW_LAUNCHES += 1
        compiled = kernel[grid](*args, **kwargs)
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            FAST = False  # a Triton whose compiled kernels launch differently: always the slow path
            return compiled
        _CACHE[key] = (compiled, _tail(kernel, len(args), kwargs))
        if len(_CACHE) > _MAX_ENTRIES:
            _CACHE.popitem(last=False)
        return compiled
    compiled, tail = entry
    g = tuple(grid) + (1, 1)
    compiled.run(g[0], g[1], g[2], driver.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)
    return compiled
