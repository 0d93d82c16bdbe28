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
kernel; later calls with the same key call its launcher directly: the C function itself when
the kernel needs no scratch memory, with each tensor handed over as its address (a Python int,
which spares the launcher a ``data_ptr()`` call and a driver query per tensor). ``bind`` goes
one step further for a launch repeated with new addresses only (a decode step): it returns a
function that makes just that one call into the C launcher. Positional arguments must be the
kernel's runtime parameters, constexprs keyword arguments. The key holds everything
Triton's specialization depends on, conservatively: the kernel, the device, every tensor's dtype,
device and 16-byte alignment (a TMA descriptor's too, with its shape, strides and block shape),
every integer's specialization class (equal to 1, a multiple of 16, 32-bit or not), every
other argument's value, and the keyword arguments (constexprs, num_warps, num_stages).
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
from triton.tools.tensor_descriptor import TensorDescriptor

from course_lib._device import INTERPRET

# Versions whose CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *args) was checked on an H100 (tests/test_ops.py's
# GPU test compares the fast path with Triton's own launch, output for output).
TESTED_TRITON = ("3.6",)
_MAX_ENTRIES = 512
_CACHE: collections.OrderedDict = collections.OrderedDict()
FAST = not INTERPRET and triton.__version__.rsplit(".", 1)[0] in TESTED_TRITON
SLOW_LAUNCHES = 0  # launches that went through Triton's own path (the tests read it)


def _descriptor_key(d: TensorDescriptor) -> tuple:
    # conservative: everything a host TMA descriptor holds but its base address
    base = d.base
    return ("desc", base.dtype, base.get_device(), not base.data_ptr() & 15,
            tuple(d.shape), tuple(d.strides), tuple(d.block_shape), d.padding,
            getattr(d, "round_f32_to_tf32", None))


def _specialization(args) -> list:
    # A list comprehension, the cheapest loop Python has (this runs on every launch), that
    # tests ``type(a) is int`` first: ``isinstance(a, torch.Tensor)`` goes through the tensor
    # metaclass's __instancecheck__ and costs several times more.
    # An integer counts by the classes Triton specializes it on (equal to 1, a multiple of 16,
    # 32 or 64 bits), not by its value: a cache that grows by a token keeps its key. That
    # tuple is ``int_classes``'s, written out here (a call per argument would cost every
    # launch): the two must stay equal, or a bound launch would take a value it cannot.
    return [(a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF) if type(a) is int else
            (a.dtype, a.get_device(), not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
            else (float if type(a) is float else
                  _descriptor_key(a) if isinstance(a, TensorDescriptor) else a) for a in args]


def int_classes(values) -> tuple:
    """The specialization classes of integers (as ``launch`` keys them): a bound launch may take
    a new integer in place of an old one when the two have the same class."""
    return tuple((a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF) for a in values)


def _pointers(args) -> list:
    # A tensor goes to the compiled launcher as its address, a Python int: the launcher then
    # skips the ``data_ptr()`` call and the driver query (cuPointerGetAttribute) it makes for
    # every tensor it is given. The key above holds each tensor's device, so a tensor on
    # another device (or the CPU) never takes this path without Triton's check first.
    # (A TensorDescriptor stays an object: the launcher encodes it.)
    return [a if type(a) is int else a.data_ptr() if isinstance(a, torch.Tensor) else a
            for a in args]


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


def hooks_installed() -> bool:
    """Whether a profiler hooked Triton's launches (then Triton launches, and calls them).
    Triton 3.5+ keeps the hooks in a ``HookChain``, never None: what counts is its ``calls``."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter is not None)
                or getattr(leave, "calls", leave is not None))


def _grid3(grid) -> tuple:
    g = tuple(grid) + (1, 1)
    return g[0], g[1], g[2]


class _Entry:
    """A compiled kernel and how to call its launcher: Triton's C function directly when the
    kernel needs no scratch memory (the Python wrapper around it then only adds time)."""

    __slots__ = ("compiled", "tail", "direct", "extra")

    def __init__(self, compiled, tail):
        self.compiled, self.tail = compiled, tail
        run = compiled.run
        self.direct = None
        if (getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0
                and hasattr(run, "launch") and hasattr(run, "launch_pdl")):
            self.direct = run.launch
            self.extra = (run.launch_cooperative_grid, run.launch_pdl, None, None)

    def __call__(self, grid, stream, args):
        c = self.compiled
        gx, gy, gz = _grid3(grid)
        if self.direct is not None:
            self.direct(gx, gy, gz, stream, c.function, *self.extra, c.packed_metadata,
                        None, None, None, *_pointers(args), *self.tail)
        else:
            c.run(gx, gy, gz, stream, c.function, c.packed_metadata, None, None, None,
                  *_pointers(args), *self.tail)


def _launch(kernel, grid, args, kwargs):
    """Launch through the cache: (the compiled kernel, its cache entry, or None where this
    Triton's compiled kernels launch differently)."""
    global FAST, SLOW_LAUNCHES
    driver = _driver.active
    device = driver.get_current_device()
    key = (kernel, device, *_specialization(args), *kwargs.items())
    entry = _CACHE.get(key)
    if entry is None or hooks_installed():
        SLOW_LAUNCHES += 1
        compiled = kernel[grid](*args, **kwargs)
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            FAST = False  # a Triton whose compiled kernels launch differently: always the slow path
            return compiled, None
        entry = _CACHE[key] = _Entry(compiled, _tail(kernel, len(args), kwargs))
        if len(_CACHE) > _MAX_ENTRIES:
            _CACHE.popitem(last=False)
        return compiled, entry
    entry(grid, driver.get_current_stream(device), args)
    return entry.compiled, entry


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, with Triton's per-call host work done once per key."""
    if not FAST or callable(grid):
        return kernel[grid](*args, **kwargs)
    return _launch(kernel, grid, args, kwargs)[0]


def bind(free, kernel, grid, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)`` now, and return ``again(*values)``: the same
    launch with the free arguments replaced by ``values``, everything else as now, on the then
    current stream. ``free`` is a number n (the first n arguments) or a tuple of positions; a
    free tensor is given as its address (an int), a free integer as its new value. ``again``
    skips even the key of ``launch``: a planned decode step (``course_lib.ops.DecodePlan``) is
    then one call into Triton's C launcher. A free argument that is a TMA descriptor keeps its
    shape, strides and block shape and moves to the new address: Triton's launcher encodes it
    there (``_DescriptorAt``).

    ``again`` checks nothing. The caller makes sure that the tensors behind the new addresses
    have the dtypes, devices and 16-byte alignment of the ones bound now, that every new
    integer has its predecessor's specialization class (``int_classes``), and that the other
    arguments would be the same (what the compiled kernel is specialised on), and that no
    profiler hooks are installed (``hooks_installed``). Returns None where the fast path is off.
    """
    if not FAST or callable(grid):
        kernel[grid](*args, **kwargs)
        return None
    _, entry = _launch(kernel, grid, args, kwargs)
    if entry is None or entry.direct is None or hooks_installed():
        return None
    gx, gy, gz = _grid3(grid)
    direct, function, packed = entry.direct, entry.compiled.function, entry.compiled.packed_metadata
    coop, pdl, scratch, profile = entry.extra
    get_stream, device = _driver.active.get_current_stream, _driver.active.get_current_device()
    if not isinstance(free, int):  # free positions anywhere: values spliced into a template
        template, positions = [*_pointers(args), *entry.tail], tuple(free)
        if any(isinstance(args[i], TensorDescriptor) for i in positions):
            raise ValueError("bind: a TMA descriptor can be free only among the first n")

        def again(*values):
            a = template.copy()
            for i, x in zip(positions, values):
                a[i] = x
            direct(gx, gy, gz, get_stream(device), function, coop, pdl, scratch, profile,
                   packed, None, None, None, *a)
        return again
    n_free = free
    fixed = (*_pointers(args[n_free:]), *entry.tail)
    descs = [(i, a) for i, a in enumerate(args[:n_free]) if isinstance(a, TensorDescriptor)]
    if descs:
        def again(*addresses):
            moved = list(addresses)
            for i, d in descs:
                moved[i] = _DescriptorAt(addresses[i], d)
            direct(gx, gy, gz, get_stream(device), function, coop, pdl, scratch, profile, packed,
                   None, None, None, *moved, *fixed)
        return again

    def again(*addresses):
        direct(gx, gy, gz, get_stream(device), function, coop, pdl, scratch, profile, packed,
               None, None, None, *addresses, *fixed)

    return again


class _Address:
    """An address that answers ``data_ptr()``, as a tensor does."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _DescriptorAt:
    """The TensorDescriptor ``like`` with its base moved to ``address``: what Triton's launcher
    reads of a descriptor (the base's ``data_ptr()``, shape, strides, padding) when it encodes
    the TMA descriptor of a launch, without building a new TensorDescriptor on the host."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "round_f32_to_tf32")

    def __init__(self, address: int, like: TensorDescriptor):
        self.base = _Address(address)
        self.shape, self.strides, self.block_shape = like.shape, like.strides, like.block_shape
        self.padding = like.padding
        self.round_f32_to_tf32 = getattr(like, "round_f32_to_tf32", False)
