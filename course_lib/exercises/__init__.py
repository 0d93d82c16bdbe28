"""Exercises: a spec, a stub the student fills in, one ``check(...)`` call that teaches.

Introduced in notebooks/00_setup.ipynb. Every exercise of the course is registered here, in one
catalogue, by the module of its lesson (``course_lib.exercises.<topic>``):

* an ``Exercise`` (kind ``"python"`` or ``"triton"``): its lesson, what the student writes, the
  stub the notebook shows, a checker, the reference solution, the mistakes students really make
  (at least two wrong answers, each of which the checker must refuse) and a ladder of hints;
* a ``Question`` (kind ``"question"``): a think-question's worked answer, and for a question
  with a number, the number and its tolerance.

In a notebook:

    check_bias_rows(bias_rows_kernel)   # ✗ not done yet / ✗ what is wrong and a nudge / ✓ passed
    hint("bias_rows")         # the next rung of the hint ladder
    solution("bias_rows")     # the reference solution: only when asked for by name
    answer("ridge_think")     # the worked answer of a think-question
    check_answer("merge_bytes", 2.1e6)   # a think-question's number

The ladder: before a first attempt (the stub still raises ``NotImplementedError``, returns
None, or a kernel still has ``...  # TODO`` lines) a checker says only that the exercise is not
done yet. A wrong attempt gets what is wrong (which case, which value, the student's output
against the expected one) and the first rung; ``hint(name)`` climbs; ``solution(name)`` prints
the reference. A notebook run with its stubs prints no solution and none of its key lines
(tests/test_exercises.py). Triton exercises run the student's kernel in the interpreter with
every load and store checked (``course_lib.exercises.sandbox``): a missing mask is a message,
not a dead Jupyter kernel.

    python -m course_lib.exercises list              # one line per exercise
    python -m course_lib.exercises verify            # solutions pass, wrong answers fail
    python -m course_lib.exercises solution NAME     # the reference solution
"""
from __future__ import annotations

import collections
import contextvars
import importlib
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

#: The modules that register exercises, in lesson order (each calls ``register`` at import).
LESSON_MODULES = (
    "course_lib.exercises.setup",            # 00
    "course_lib.exercises.softmax",          # 01, 01b
    "course_lib.exercises.matmul",           # 02, 03
    "course_lib.exercises.puzzles",          # 02b
    "course_lib.exercises.attention",        # 04, 05, 06
    "course_lib.exercises.triton_flash_v1",  # 07
    "course_lib.exercises.flash_v2",         # 08, 09
    "course_lib.exercises.fp8",              # 09b
    "course_lib.exercises.backward",         # 10
    "course_lib.exercises.decode",           # 11, 12, 13
    "course_lib.exercises.llama",            # 14
    "course_lib.exercises.variants",         # 15
    "course_lib.exercises.serving",          # 16
)


# ---------------------------------------------------------------------------------------------
# Results and the catalogue
# ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    """What a checker found; truthy when the exercise is solved.

    ``status``: "todo" (the stub is untouched), "wrong" (an attempt that fails) or "passed".
    """

    name: str
    passed: bool
    message: str
    status: str = ""

    def __post_init__(self):
        if not self.status:
            self.status = "passed" if self.passed else "wrong"

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"{self.name}: {self.status}"


@dataclass(frozen=True)
class Mistake:
    """A wrong answer students really give: ``answer`` must fail the checker, and the message
    must contain ``expect`` (what a student would be told)."""

    label: str
    answer: Callable
    expect: str = ""


@dataclass
class Exercise:
    name: str                     # unique, used by hint(), solution(), the catalogue
    lesson: str                   # notebook stem, e.g. "00_setup"
    kind: str                     # "python" or "triton"
    writes: str                   # what the student writes, in a few words
    lines: int                    # about how many lines that is
    check: Callable               # check(student, show=True) -> Result
    solution: Callable            # the reference: a function, or a @triton.jit kernel
    stub: Callable                # what the notebook shows (raises, or has ... # TODO lines)
    mistakes: tuple = ()          # Mistake(...), at least two
    hints: tuple = ()             # the ladder, from a nudge to nearly there; never the answer
    extra: tuple = ()             # more source to print with the solution (a launcher)


@dataclass
class Question:
    name: str
    lesson: str
    asks: str                     # the question, in a line
    answer: str                   # the worked answer (markdown-ish text)
    value: float | None = None    # the number, for a question that has one
    rtol: float = 0.02
    kind: str = field(default="question", init=False)


_REGISTRY: dict[str, Exercise | Question] = {}
_HINTS_SHOWN: dict[str, int] = {}


def register(item: Exercise | Question) -> Exercise | Question:
    """Add an exercise or question to the catalogue (its lesson module does, at import)."""
    if item.name in _REGISTRY and _REGISTRY[item.name] is not item:
        raise ValueError(f"exercise {item.name!r} registered twice")
    if isinstance(item, Exercise):
        if item.kind not in ("python", "triton"):
            raise ValueError(f"{item.name}: kind must be 'python' or 'triton', got {item.kind!r}")
        if len(item.mistakes) < 2:
            raise ValueError(f"{item.name}: register at least two wrong answers")
        if not item.hints:
            raise ValueError(f"{item.name}: give at least one hint")
    _REGISTRY[item.name] = item
    return item


def catalogue() -> dict[str, Exercise | Question]:
    """Every exercise and question of the course, in lesson order."""
    for module in LESSON_MODULES:
        importlib.import_module(module)
    order = {m: i for i, m in enumerate(sorted({e.lesson for e in _REGISTRY.values()}))}
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (order[kv[1].lesson],
                                                            list(_REGISTRY).index(kv[0]))))


def _get(name: str):
    items = catalogue()
    if name not in items:
        close = [n for n in items if name.lower() in n.lower()]
        raise KeyError(f"no exercise or question named {name!r}"
                       + (f"; did you mean {close}?" if close else
                          "; python -m course_lib.exercises list shows them all"))
    return items[name]


# ---------------------------------------------------------------------------------------------
# The ladder: hint, solution, answer
# ---------------------------------------------------------------------------------------------

def hint(name: str) -> None:
    """Print the next hint of exercise ``name`` (the first is the nudge a wrong attempt gets).
    Returns nothing: a returned string would show a second time under a notebook cell."""
    ex = _get(name)
    if isinstance(ex, Question):
        text = f"{name} is a question: answer('{name}') shows the worked answer."
    else:
        level = _HINTS_SHOWN.get(name, 0)
        if level < len(ex.hints):
            _HINTS_SHOWN[name] = level + 1
            text = f"hint {level + 1} of {len(ex.hints)} for {name}: {ex.hints[level]}"
        else:
            text = (f"That was the last hint for {name}. The reference solution: "
                    f"solution('{name}').")
    print(text)


def solution_source(name: str) -> str:
    """The reference solution's source text (and any launcher it needs)."""
    ex = _get(name)
    if isinstance(ex, Question):
        return ex.answer
    from course_lib.exercises.sandbox import python_function

    parts = [textwrap.dedent(inspect.getsource(python_function(ex.solution)))]
    parts += [textwrap.dedent(inspect.getsource(python_function(f))) for f in ex.extra]
    return "\n\n".join(p.rstrip() for p in parts)


def solution(name: str) -> None:
    """Print the reference solution of exercise ``name``: asked for by name, never shown
    otherwise."""
    print(f"# reference solution of {name!r}\n" + solution_source(name))


def answer(name: str) -> None:
    """Print the worked answer of think-question ``name``."""
    q = _get(name)
    if not isinstance(q, Question):
        raise KeyError(f"{name!r} is an exercise: hint('{name}') and solution('{name}')")
    body = q.answer if "\n" in q.answer else textwrap.fill(q.answer, 96)
    print(f"{q.asks}\n\n{body}")


def check_answer(name: str, value, show: bool = True) -> Result:
    """Check the number a think-question asks for (within its relative tolerance)."""
    q = _get(name)
    if not isinstance(q, Question) or q.value is None:
        raise KeyError(f"{name!r} is not a question with a number")
    if value is None or value is ...:
        return _report(Result(name, False, "not done yet: put your number in place of ...",
                              "todo"), show)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return _report(Result(name, False, f"expected a number, got {value!r}"), show)
    ok = np.isclose(v, q.value, rtol=q.rtol, atol=0)
    msg = (f"{v:.4g} is right (within {q.rtol:.0%}); answer('{name}') shows the worked answer"
           if ok else f"{v:.4g} is not it (off by more than {q.rtol:.0%}). Check the units "
           f"and every factor; answer('{name}') shows the worked answer")
    return _report(Result(name, bool(ok), msg), show)


# ---------------------------------------------------------------------------------------------
# Checking a Python function
# ---------------------------------------------------------------------------------------------

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


def _show(a) -> str:
    a = np.asarray(a)
    if a.size <= 12:
        return np.array2string(a, precision=4, separator=", ", threshold=12)
    return f"array of shape {a.shape}"


def _compare(got, want, rtol, atol) -> str | None:
    """None if equal within tolerance, else where they differ: the student's output, the
    expected one, the first index that differs and how many do."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"expected a tuple of {len(want)} values, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            why = _compare(g, w, rtol, atol)
            if why:
                return f"item {i}: {why}"
        return None
    if np.shape(got) != np.shape(want):
        return f"your output has shape {np.shape(got)}, expected {np.shape(want)}"
    close = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if close.all():
        return None
    idx = tuple(int(i) for i in np.argwhere(~close)[0])
    got_a, want_a = np.asarray(got), np.asarray(want)
    where = f"index {idx}: yours {float(got_a[idx]):.6g}, expected {float(want_a[idx]):.6g}"
    if np.isnan(got_a[idx]) and not np.isnan(want_a[idx]):
        where += " (NaN: never written, or a 0/0 or inf − inf)"
    text = f"{int((~close).sum())} of {close.size} values differ; first at {where}"
    if got_a.size <= 12:
        text += f"\n    yours:    {_show(got_a)}\n    expected: {_show(want_a)}"
    return text


def _describe(args) -> str:
    parts = []
    for a in args:
        shape = getattr(a, "shape", None)
        parts.append(f"shape {tuple(shape)}" if shape is not None else repr(a))
    return ", ".join(parts)


#: Nudges for failures every Triton exercise shares (``check_kernel``), by what the message says.
KERNEL_NUDGES = {
    "out of bounds": "a load or store without a mask (or with a mask that lets one lane too "
                     "many through) touches memory outside its tensor; mask every access whose "
                     "block can hang over the end.",
    "NaN: never written": "some outputs were never written: does every program write its own "
                          "block (program_id), and does the grid cover every element?",
}


def _nudge(name: str, hints, message: str = "", nudges=None) -> str:
    """The first rung, or a nudge chosen by what went wrong (``nudges``: {text in the message:
    nudge}), and where to get more."""
    if not hints:
        return ""
    first = next((n for key, n in (nudges or {}).items() if key in message), hints[0])
    more = f" More: hint('{name}')." if len(hints) > 1 or first != hints[0] else ""
    return f"\n  Nudge: {first}{more}"


TODO = "not done yet: write the lines marked TODO, then run this cell again."


# ---------------------------------------------------------------------------------------------
# Recognising a registered mistake by its signature: the outputs it gives on the failing case
# ---------------------------------------------------------------------------------------------

#: While set to (exercise name, case number), ``check`` and ``check_kernel`` run only that case
#: and raise ``_Probed`` with its outputs: how a registered mistake's outputs are found.
_PROBE: contextvars.ContextVar = contextvars.ContextVar("exercise_probe", default=None)


class _Probed(Exception):
    def __init__(self, output):
        super().__init__("probed")
        self.output = output


def _probing(name: str):
    """The case number to probe when ``name``'s checker runs inside ``_signature``, else None."""
    probe = _PROBE.get()
    return probe[1] if probe is not None and probe[0] == name else None


def _same(got, output, rtol: float, atol: float) -> bool:
    """Whether two outcomes of one case are the same: equal outputs, or the same event (("event",
    what happened): an access out of bounds, the loads of a kernel whose outputs are right)."""
    def event(x):
        return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and x[0] == "event"

    if event(got) or event(output):
        return event(got) and event(output) and got == output
    try:
        return _compare(_as_array(got), _as_array(output), rtol, atol) is None
    except (TypeError, ValueError):
        return False


def _touched(oob: str) -> str:
    """What an out-of-bounds message says was touched, without the line (a student's line
    numbers are not a mistake's): "tl.load of 208 lanes"."""
    import re

    op = re.search(r"(tl\.\w+) out of bounds", oob)
    lanes = re.search(r"\d+ of (\d+) addresses", oob)
    if not (op and lanes):
        return oob
    # how many lanes the access had (its mask let through) is the kernel's; which of them fall
    # outside, and in which tensor, depends on where the allocator put the tensors
    return f"{op.group(1)} of {lanes.group(1)} lanes"


def _signature(name: str, n: int, got, rtol: float, atol: float) -> str | None:
    """The registered mistakes of exercise ``name`` whose outcome on case ``n`` is the
    student's (``got``), as a diagnosis; None when none is. Each mistake runs on that one case
    only (the interpreter, for a kernel): a failed check costs a few more runs, a passed one
    none."""
    ex = _REGISTRY.get(name)
    if not isinstance(ex, Exercise) or _PROBE.get() is not None:
        return None
    matches = []
    for m in ex.mistakes:
        token = _PROBE.set((name, n))
        try:
            ex.check(m.answer, show=False)
            continue  # it did not reach the case: it raised or failed earlier
        except _Probed as probed:
            output = probed.output
        except Exception:
            continue
        finally:
            _PROBE.reset(token)
        if _same(got, output, rtol, atol):
            matches.append(m.label)
    if not matches:
        return None
    return ("\n  Diagnosis: on this case yours does exactly what a mistake students make does: "
            + "; or ".join(matches) + ".")


def _diagnosed(name: str, hints, message: str, nudges, diagnosis: str | None) -> str:
    """What follows a failure: the diagnosis, when a registered mistake's signature matched,
    with the nudge chosen by what the message says (never the ladder's first rung, which may
    point elsewhere); else the nudge as ``_nudge`` picks it."""
    if not diagnosis:
        return _nudge(name, hints, message, nudges)
    keyed = next((n for key, n in (nudges or {}).items()
                  if key in message and not key.endswith(":")), None)  # not "which output"
    return diagnosis + (f"\n  Nudge: {keyed}" if keyed else "") + f" More: hint('{name}')."


def check(name: str, student: Callable, spec: Callable, cases, hints=(),
          rtol: float = 1e-6, atol: float = 1e-9, show: bool = True, describe=None,
          nudges=None, hint=None, names=None) -> Result:
    """Run ``student(*args)`` and ``spec(*args)`` on every case and compare.

    ``cases`` is a list of argument tuples (seeded by the caller, so failures reproduce);
    ``describe(args)`` names a case in words (default: shapes and values). ``hints``: the
    ladder (a str is one rung); a wrong attempt gets the first, or the entry of ``nudges``
    ({text in the failure message: nudge}) that matches what went wrong. ``names``: the names
    of a tuple's outputs, which a failure then starts with ("m′: 1 of 4 values differ ...").
    """
    hints = (hints,) if isinstance(hints, str) else tuple(hints)
    if hint is not None:  # a single rung, the older spelling
        hints = (hint,) + hints
    from course_lib.exercises.sandbox import is_kernel

    if is_kernel(student):
        return _report(Result(name, False, "this exercise asks for a Python function, not a "
                              "@triton.jit kernel"), show)
    probe = _probing(name)
    for n, args in enumerate(cases):
        if probe is not None and n != probe:
            continue
        label = describe(args) if describe else _describe(args)
        try:
            got = student(*args)
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            raised = ("event", f"{type(exc).__name__}: {_touched(str(exc))}")
            if probe is not None:
                raise _Probed(raised) from None
            why = f"case {n} ({label}) raised {type(exc).__name__}: {exc}"
            return _report(Result(name, False, why + _diagnosed(
                name, hints, why, nudges, _signature(name, n, raised, rtol, atol))), show)
        if got is None:
            if n == 0:
                return _report(Result(name, False, TODO + " (it returns None)", "todo"), show)
            why = f"case {n} ({label}) returned None"
            return _report(Result(name, False, why + _nudge(name, hints, why, nudges)), show)
        if probe is not None:
            raise _Probed(got)
        want = spec(*args)
        why = _compare(_as_array(got), _as_array(want), rtol, atol)
        if why and names and why.startswith("item "):
            i = int(why.split(":")[0].split()[1])
            why = f"{names[i]}:{why.split(':', 1)[1]}"
        if why:
            why = f"case {n} ({label}): {why}"
            nudge = _diagnosed(name, hints, why, nudges, _signature(name, n, got, rtol, atol))
            return _report(Result(name, False, why + nudge), show)
    return _report(Result(name, True, f"all {len(cases)} cases match"), show)


# ---------------------------------------------------------------------------------------------
# Checking a Triton kernel
# ---------------------------------------------------------------------------------------------

def check_kernel(name: str, kernel, prepare: Callable, spec: Callable, cases, hints=(),
                 rtol: float = 1e-5, atol: float = 1e-6, show: bool = True,
                 describe=None, nudges=None, names=None, explain=None,
                 undefined=None, visits=None) -> Result:
    """A Triton exercise: run the student's ``@triton.jit`` kernel on every case and compare.

    ``prepare(*case) -> (grid, args, outputs)`` lays out one launch: the grid, the kernel's
    arguments by the skeleton's parameter names, and the output tensors (poisoned with NaN, so
    an element never written fails). ``spec(*case)`` gives the expected outputs. Cases hold CPU
    tensors. Every case first runs in the interpreter with each load and store checked
    (``sandbox``); on a GPU the kernel then runs compiled on CUDA copies of the same cases.
    ``nudges`` add to ``KERNEL_NUDGES`` (a missing mask, unwritten outputs). ``names``: the
    outputs' names, which a failure then starts with ("z: 3 of 60 values differ ...");
    ``explain(case, got, want) -> str`` adds what it sees in outputs that differ (a map of the
    wrong elements, a registered mistake recognised by its signature). ``undefined``: what a
    masked lane of a load without ``other=`` reads in the interpreter (``sandbox.guarded``).
    ``visits(case, loads) -> str | None``: in the interpreter, what is wrong with the loads each
    program made ({(tensor name, program): loads}, ``sandbox.guarded``), e.g. key blocks a
    window kernel should have skipped; checked once the outputs are right.
    """
    import torch

    from course_lib._device import DEVICE
    from course_lib.exercises import sandbox

    hints = (hints,) if isinstance(hints, str) else tuple(hints)
    if not sandbox.is_kernel(kernel):
        what = type(kernel).__name__
        return _report(Result(name, False, f"this exercise asks for a @triton.jit kernel, and "
                              f"got a {what}: an answer in PyTorch or NumPy does not count. "
                              "Fill in the kernel above (keep its @triton.jit line) and pass "
                              "the kernel itself."), show)
    left = sandbox.blanks(kernel)
    if left:
        return _report(Result(name, False, f"not done yet: {left} line{'s' * (left > 1)} of "
                              "the kernel still read `...  # TODO`. Write them, then run "
                              "this cell again.", "todo"), show)

    def outputs_tuple(outs):
        return outs if isinstance(outs, tuple) else (outs,)

    def one_run(n, host_case, compiled: bool):
        # the kernel runs on the device's copy; the spec and the explanation, on the CPU's
        case = tuple(c.cuda() if compiled and isinstance(c, torch.Tensor) else c
                     for c in host_case)
        label = describe(host_case) if describe else _describe(host_case)
        grid, args, outs = prepare(*case)
        loads = collections.Counter() if visits is not None and not compiled else None
        try:
            if compiled:
                kernel[grid](**args)
                torch.cuda.synchronize()
                oob = None
            else:
                tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
                oob = sandbox.run(kernel, grid, args, tensors, undefined=undefined,
                                  loads=loads)
        except Exception as exc:  # the student's kernel raised or did not compile
            return f"case {n} ({label}): your kernel raised {sandbox.describe(exc)}"
        if oob:
            if probe is not None:
                raise _Probed(("event", _touched(oob)))
            return f"case {n} ({label}): {oob}", ("event", _touched(oob))
        got = tuple(o.float().cpu() for o in outputs_tuple(outs))
        if probe is not None and loads is None:
            raise _Probed(got)
        want = tuple(w.float().cpu() for w in outputs_tuple(spec(*host_case)))
        if names:
            why = next((f"{nm}: {w}" for nm, g, e in zip(names, got, want)
                        if (w := _compare(_as_array(g), _as_array(e), rtol, atol))), None)
        else:
            why = _compare(_as_array(got if len(got) > 1 else got[0]),
                           _as_array(want if len(want) > 1 else want[0]), rtol, atol)
        if why is not None and explain is not None:
            more = explain(host_case, got, want)
            why += f"\n  {more}" if more else ""
        outcome = got
        if why is None and loads is not None:
            why = visits(host_case, loads)
            if why:  # right outputs, wrong loads: the loads are the signature
                outcome = ("event", "loads " + repr(sorted(loads.items())))
        if probe is not None:
            raise _Probed(outcome)
        if why is None:
            return None
        why = f"case {n} ({label})" + (", compiled on the GPU" if compiled else "") + f": {why}"
        return why, outcome

    probe = _probing(name)
    passes = [False] + ([True] if DEVICE == "cuda" and probe is None else [])
    for compiled in passes:
        for n, case in enumerate(cases):
            if probe is not None and n != probe:
                continue
            found = one_run(n, case, compiled)
            if found:
                why, got = found if isinstance(found, tuple) else (found, None)
                diagnosis = (_signature(name, n, got, rtol, atol)
                             if got is not None and not compiled else None)
                nudge = _diagnosed(name, hints, why, {**KERNEL_NUDGES, **(nudges or {})},
                                   diagnosis)
                return _report(Result(name, False, why + nudge), show)
    where = "in the interpreter and compiled on the GPU" if len(passes) > 1 else \
        "in the interpreter, every load and store in bounds"
    return _report(Result(name, True, f"all {len(cases)} cases match, {where}"), show)


def poisoned(*shape, like=None, dtype=None, device=None):
    """An output tensor filled with NaN: an element the kernel never writes fails the check."""
    import torch

    if like is not None:
        dtype = dtype or like.dtype
        device = device or like.device
    return torch.full(shape, float("nan"), dtype=dtype or torch.float32, device=device)


def _report(result: Result, show: bool) -> Result:
    if show:
        mark = "✓" if result.passed else "✗"
        print(f"{mark} {result.name}: {result.message}")
    return result
