"""Launch a Triton kernel again for a fraction of Triton's host time.

Before the GPU sees anything, ``kernel[grid](*args, **kwargs)`` binds the arguments, computes
their *specialization*, looks up the compiled kernel, checks the globals it reads and builds
launch metadata. For a decode step of a few tens of µs on the GPU, that host work decides the
step's time (lesson 12, section 8, measures it: course_lib/data/dropin.json, ``host``).

``bind(free, kernel, grid, *args, **kwargs)`` launches ``kernel[grid](*args, **kwargs)`` through
Triton (which compiles if needed) and returns ``again(*values)``: the same launch with the
``free`` arguments replaced by ``values``, one call into the compiled kernel's C launcher. The
public calls keep what it returns: ``flash_attn_v2``'s fast path (``ops.attention``) and a decode
plan (``ops.decode``); every other launch is Triton's own. Positional arguments must be the
kernel's runtime parameters, constexprs keyword arguments.

Triton does everything in the interpreter and when a launch hook is installed (a profiler). Its
C launcher is internal, and its arguments changed at 3.7: ``_direct`` knows 3.6's form and that
of 3.7 to 3.9, else it calls the compiled kernel's ``run``, the interface every supported version
shares.
"""
from __future__ import annotations

import inspect

import torch
import triton
from triton import knobs as _knobs
from triton.runtime.driver import driver as _driver
from triton.tools.tensor_descriptor import TensorDescriptor

from course_lib._device import INTERPRET

# The Triton versions the course supports; tests/test_ops.py's GPU tests compare the fast path
# with Triton's own launch, output for output, on the installed one.
SUPPORTED_TRITON = ("3.6", "3.7", "3.8", "3.9")
FAST = not INTERPRET and triton.__version__.rsplit(".", 1)[0] in SUPPORTED_TRITON
SLOW_LAUNCHES = 0  # launches through Triton's own path, here (the tests read it)


def int_classes(values) -> tuple:
    """The specialization classes of integers, as Triton's launch tells them apart (1, a multiple
    of 16, 32 or 64 bits): a bound launch may take a new integer in place of an old one when the
    two have the same class."""
    return tuple((a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF) for a in values)


def _pointers(args) -> list:
    # A tensor goes to the launcher as its address: it then skips a ``data_ptr()`` call and a
    # driver query (cuPointerGetAttribute) per tensor (``bind``'s caller vouches for the
    # device). A TensorDescriptor stays: the launcher encodes it.
    return [a if type(a) is int else a.data_ptr() if isinstance(a, torch.Tensor) else
            tuple(_pointers(a)) if type(a) is tuple else a for a in args]


def _tail(kernel, n_positional: int, kwargs: dict) -> tuple:
    """The values of the parameters after the positional ones, in the kernel's order: what the
    launcher takes after them (constexprs included; it skips them)."""
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
    """Whether a profiler hooked Triton's launches (then Triton launches). Triton 3.5+ keeps
    the hooks in a ``HookChain``, never None: what counts is its ``calls``."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter is not None)
                or getattr(leave, "calls", leave is not None))


def _direct(compiled):
    """``call(gx, gy, gz, stream, args)``: the compiled kernel's launch with no hooks. One call
    into Triton's C launcher where the kernel needs no scratch memory (the Python wrapper
    around it then only adds time), else ``compiled.run``."""
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    direct = getattr(run, "launch", None)
    if (direct is None or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0 or getattr(run, "gsan_enabled", False)):
        return lambda gx, gy, gz, stream, args: run(gx, gy, gz, stream, function, packed, None,
                                                    None, None, *args)
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    if hasattr(run, "arg_annotations"):  # Triton 3.7 to 3.9: the arguments as one tuple
        notes, signature = run.arg_annotations, run.kernel_signature
        return lambda gx, gy, gz, stream, args: direct(gx, gy, gz, stream, function, coop, pdl,
                                                       packed, None, None, None, None, None,
                                                       notes, signature, tuple(args))
    return lambda gx, gy, gz, stream, args: direct(gx, gy, gz, stream, function, coop, pdl,  # 3.6
                                                   None, None, packed, None, None, None, *args)


def bind(free, kernel, grid, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)`` now, and return ``again(*values)``: the same
    launch with the free arguments replaced by ``values``, on the then current stream. ``free``
    is a number n (the first n arguments) or a tuple of positions (None: launch, bind nothing);
    a free tensor is given as its address (an int), a free integer as its new value. ``again``
    is one call into Triton's C launcher. A free TMA descriptor keeps its shape, strides and
    block shape and moves to the new address (``_DescriptorAt``).

    ``again`` checks nothing. The caller makes sure that the tensors behind the new addresses
    have the dtypes, devices and 16-byte alignment of the ones bound now, that every new
    integer has its predecessor's specialization class (``int_classes``), that the other
    arguments would be the same, and that no profiler hooks are installed
    (``hooks_installed``). Returns None where the fast path is off.
    """
    global FAST, SLOW_LAUNCHES
    compiled = kernel[grid](*args, **kwargs)
    SLOW_LAUNCHES += 1
    if free is None or not FAST or callable(grid) or hooks_installed():
        return None
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        FAST = False  # compiled kernels that launch differently: Triton's own launch only
        return None
    gx, gy, gz = (*grid, 1, 1)[:3]
    call, get_stream = _direct(compiled), _driver.active.get_current_stream
    device = _driver.active.get_current_device()
    template = [*_pointers(args), *_tail(kernel, len(args), kwargs)]
    if isinstance(free, int):
        free = tuple(range(free))
    descs = {i: args[i] for i in free if isinstance(args[i], TensorDescriptor)}
    if not descs and free == tuple(range(len(free))):  # the first n: the common, fastest case
        fixed = template[len(free):]

        def again(*values):
            call(gx, gy, gz, get_stream(device), [*values, *fixed])
        return again

    def again(*values):
        a = template.copy()
        for i, x in zip(free, values):
            a[i] = _DescriptorAt(x, descs[i]) if i in descs else x
        call(gx, gy, gz, get_stream(device), a)

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
    reads when it encodes a TMA descriptor, without building a new TensorDescriptor."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "round_f32_to_tf32")

    def __init__(self, address: int, like: TensorDescriptor):
        self.base = _Address(address)
        self.shape, self.strides, self.block_shape = like.shape, like.strides, like.block_shape
        self.padding = like.padding
        self.round_f32_to_tf32 = getattr(like, "round_f32_to_tf32", False)
