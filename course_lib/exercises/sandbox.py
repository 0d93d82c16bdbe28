"""Running a student's Triton kernel safely: in the interpreter, every load and store checked.

Introduced in notebooks/00_setup.ipynb, used by every Triton exercise.

Triton's interpreter runs a kernel as Python on the CPU, and its loads and stores are raw memory
accesses: a load past the end of a tensor reads whatever lies there, a store past it overwrites
the interpreter's own memory. Without a mask, that is a segmentation fault or a heap-corruption
abort, and in JupyterLab the student's kernel dies with all its state and no message.

``guarded(tensors, kernel)`` is a context manager that wraps the interpreter's memory
operations (``create_masked_load``, ``create_masked_store`` and ``create_atomic_rmw`` of its
builder, through which every ``tl.load``, ``tl.store`` and ``tl.atomic_add`` goes) with a check:
every address an access touches (its unmasked lanes only) must lie inside one of the tensors
given to the launch. The first one
that does not stops the kernel with ``OutOfBounds``, naming the operation, the line of the
student's kernel, how many addresses were outside and the nearest tensor ("element 1027 of x,
which has 1025"). The real access never happens, so the process survives.

``undefined``: what a masked-off lane of a load without ``other=`` reads. The interpreter gives
0, which hides a missing ``other=``: on a GPU the value is undefined, whatever the lane's
register held. An exercise whose kernel reduces over masked lanes (a sum, a max, a dot product)
passes ``undefined=float("nan")``, and a missing ``other=`` shows up as NaN.

This is the same idea as the Sanitizer of triton-viz (the tool Triton-Puzzles is built on,
https://github.com/Deep-Learning-Profiling-Tools/triton-viz), done with the interpreter's own
hooks and no extra dependency. On a GPU the exercises first run the student's kernel this way
(``as_interpreted``: the same source, interpreted, on CPU copies of small inputs), and compile
it for the GPU only once it stays in bounds: an out-of-bounds access on the GPU would poison the
CUDA context for the rest of the session.

Works with the interpreters of Triton 3.6 to 3.9 (their builders name these methods alike;
the arguments after ``mask`` differ, and are passed through).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import linecache
import re
import textwrap
import warnings

import numpy as np


class OutOfBounds(Exception):
    """A student's kernel loaded or stored outside every tensor it was given."""


class NotAKernel(TypeError):
    """A Triton exercise was given something that is not a ``@triton.jit`` kernel."""


def is_kernel(obj) -> bool:
    """True for a ``@triton.jit`` function, compiled (JITFunction) or interpreted."""
    from triton.runtime.jit import JITFunction
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = ()
    return isinstance(obj, (JITFunction, InterpretedFunction))


def python_function(kernel):
    """The plain Python function a ``@triton.jit`` kernel was made from."""
    return getattr(kernel, "fn", kernel)


def source(kernel) -> str:
    """The kernel's source text (from its cell or file)."""
    return inspect.getsource(python_function(kernel))


_VARIANTS = itertools.count()


def kernel_variant(kernel, *edits):
    """``kernel`` with text replaced, as a new ``@triton.jit`` kernel: a registered wrong answer.

    ``edits``: (old, new) pairs, each ``old`` found exactly once in the kernel's source. The new
    source is kept in ``linecache`` (as Jupyter does for cells), so that Triton, the
    interpreter and the sandbox's line numbers can read it like any other kernel's.
    """
    fn = python_function(kernel)
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in edits:
        if src.count(old) != 1:
            raise ValueError(f"{fn.__name__}: {old!r} occurs {src.count(old)} times, not once")
        src = src.replace(old, new)
    filename = f"<wrong answer {next(_VARIANTS)}: {fn.__name__}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(src, filename, "exec"), fn.__globals__, namespace)
    return namespace[fn.__name__]


_BLANK = re.compile(r"^\s*(?:[\w\[\], .]+=\s*)?\.\.\.\s*(?:#.*)?$", re.M)


def blanks(kernel_or_source) -> int:
    """How many lines still read ``... # TODO`` (a skeleton's blanks not yet written)."""
    text = kernel_or_source if isinstance(kernel_or_source, str) else source(kernel_or_source)
    return len(_BLANK.findall(text))


def as_interpreted(kernel):
    """The same kernel, run by the interpreter (on a GPU machine, for the guarded first pass)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    return InterpretedFunction(python_function(kernel))


def _storage_range(t) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _where(fn_name: str) -> str:
    """'line N: <code>' of the innermost frame of the student's kernel on the stack."""
    for info in inspect.stack(context=1):
        if info.frame.f_code.co_name == fn_name:
            code = (info.code_context or [""])[0].strip()
            return f"line {info.lineno}: {code}" if code else f"line {info.lineno}"
    return "an unknown line"


@contextlib.contextmanager
def guarded(tensors: dict, kernel, undefined=None, loads=None):
    """Check every load, store and atomic add of ``kernel`` against ``tensors`` ({name: tensor}).
    ``undefined``: the value a masked-off lane of a floating-point load without ``other=``
    reads (None: the interpreter's 0). ``loads``: a ``collections.Counter`` that counts the
    loads of each program from each tensor, {(tensor name, program (x, y, z)): loads}.

    Raises ``OutOfBounds`` (wrapped by the interpreter in an ``InterpreterError``; ``run``
    unwraps it) at the first access outside all of them.
    """
    from triton.runtime import interpreter as ti

    builder = ti.interpreter_builder
    ranges = [(name, *_storage_range(t), t) for name, t in tensors.items()]
    fn_name = python_function(kernel).__name__

    def check(kind, ptrs, mask):
        addrs = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addrs = addrs[np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)]
        if not addrs.size:
            return
        size = np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize
        # One load or store reads one tensor: its lanes must all lie in the tensor that holds
        # most of them (a load that runs off x into the next allocation is still an error).
        best, holder = np.zeros(addrs.shape, dtype=bool), None
        for name, lo, hi, _ in ranges:
            inside = (addrs >= lo) & (addrs + size <= hi)
            if inside.sum() > best.sum():
                best, holder = inside, name
        if loads is not None and kind == "tl.load":
            loads[holder, tuple(builder.grid_idx)] += 1
        if best.all():
            return
        inside = best
        bad = int(addrs[~inside][0])
        raise OutOfBounds(f"{kind} out of bounds at {_where(fn_name)}: "
                          f"{int((~inside).sum())} of {addrs.size} addresses are outside the "
                          f"tensor it accesses ({_nearest(bad, size, ranges)}). Check the "
                          f"mask of this {kind}.")

    real_load, real_store = builder.create_masked_load, builder.create_masked_store

    def load(ptrs, mask, other, *args, **kwargs):
        check("tl.load", ptrs, mask)
        if other is None and undefined is not None:
            dtype = np.dtype(ti._get_np_dtype(ptrs.get_element_ty()))
            if dtype.kind == "f":
                other = ti.TensorHandle(np.full(np.shape(ptrs.data), undefined, dtype=dtype),
                                        ptrs.get_element_ty())
        return real_load(ptrs, mask, other, *args, **kwargs)

    def store(ptrs, value, mask, *args, **kwargs):
        check("tl.store", ptrs, mask)
        return real_store(ptrs, value, mask, *args, **kwargs)

    real_atomic = builder.create_atomic_rmw

    def atomic(op, ptrs, value, mask, *args, **kwargs):
        check("tl.atomic_add" if "ADD" in str(op).upper() else "atomic", ptrs, mask)
        return real_atomic(op, ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw = atomic
    try:
        yield
    finally:
        del builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw


def _nearest(addr: int, size: int, ranges) -> str:
    """'element 1027 of x, which has 1025' for the tensor that ends nearest below ``addr``."""
    below = [(addr - lo, name, t) for name, lo, hi, t in ranges if lo <= addr]
    if not below:
        return "the first address lies before every tensor: a negative offset?"
    offset, name, t = min(below)
    return (f"the first is element {offset // max(size, 1)} of {name}, "
            f"which has {t.untyped_storage().nbytes() // t.element_size()}")


@contextlib.contextmanager
def interpreter_compat():
    """Let the interpreter run a kernel the same way with any Triton 3.6–3.9 and NumPy.

    * On a GPU machine (kernels compiled, not interpreted), Triton's own ``@triton.jit`` helpers
      (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) are compiled functions that refuse to be
      called outside a compiled kernel; here they run interpreted too.
    * Triton 3.6's interpreter turns a scalar argument into an int by ``int(array)``, which
      NumPy 2.5 refuses for a one-element array: ``range(0, N)`` over a kernel argument failed.
      Triton 3.9 takes the one element; so does this.
    """
    from triton.runtime import interpreter as ti
    from triton.runtime.jit import JITFunction

    real_patch, real_call = ti._patch_lang_tensor, JITFunction.__call__
    interpreted = {}

    def patch_tensor(tensor, scope):
        real_patch(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def call_interpreted(self, *args, **kwargs):
        if self.fn not in interpreted:
            interpreted[self.fn] = ti.InterpretedFunction(self.fn)
        return interpreted[self.fn](*args, **kwargs)

    import triton.language as tl

    # The interpreter patches triton.language while it runs; Triton 3.6 does not undo all of
    # it, and a kernel compiled for the GPU afterwards then fails ("Cannot call @triton.jit'd
    # outside of the scope of a kernel"). Everything it may touch is put back as it was.
    spaces = [tl, tl.core, tl.standard, tl.math, tl.tensor, tl.core.tensor]
    saved = [(space, dict(vars(space))) for space in spaces]
    ti._patch_lang_tensor, JITFunction.__call__ = patch_tensor, call_interpreted
    try:
        yield
    finally:
        ti._patch_lang_tensor, JITFunction.__call__ = real_patch, real_call
        for space, before in saved:
            if isinstance(space, type):  # methods patched onto tl.tensor: removed
                for key in [k for k in vars(space) if k not in before]:
                    delattr(space, key)
            # (names the interpreter adds to a module's globals stay: the rewritten copies of
            # tl.sum and friends that it caches refer to them)
            for key, value in before.items():
                if vars(space).get(key, _MISSING) is not value:
                    setattr(space, key, value)


_MISSING = object()


def run(kernel, grid, args: dict, tensors: dict, undefined=None, loads=None):
    """Launch ``kernel[grid](**args)`` in the interpreter under ``guarded(tensors, kernel,
    undefined, loads)``.

    Returns None, or the ``OutOfBounds`` message when the kernel left its tensors. Any other
    error propagates (the interpreter wraps the student's exceptions; ``describe`` reads them).
    """
    interpreted = as_interpreted(kernel)
    try:
        # A wrong kernel overflows or divides by zero; the checker says what came out, so
        # NumPy's RuntimeWarnings (red boxes in JupyterLab) would only add noise.
        with interpreter_compat(), guarded(tensors, kernel, undefined, loads), \
                np.errstate(all="ignore"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            interpreted[grid](**args)
    except Exception as exc:  # the interpreter wraps what the kernel raised
        inner = exc
        while inner is not None and not isinstance(inner, OutOfBounds):
            inner = inner.__cause__ or inner.__context__
        if isinstance(inner, OutOfBounds):
            return str(inner)
        raise
    return None


def describe(exc: BaseException) -> str:
    """One line for an exception raised while running a student's kernel."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}"[:400]
