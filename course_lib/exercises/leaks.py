"""Nothing on the page gives an exercise away: the key lines of its answer appear nowhere above
its stub, in no other exercise's skeleton, and in no output printed before it.

An exercise's *key lines* are the lines of its reference solution that its stub leaves blank
(``key_lines``): what the student must find. ``leaks(lesson, cells)`` looks for them in a
notebook's cells, given as (cell type, source, printed output) in order:

* in the source and the output of every cell above the exercise's stub (a kernel printed by
  ``inspect.getsource`` above a check is its answer on the page);
* in every other exercise's stub below it (a later skeleton that shows an earlier answer).

The library's own version of what the student writes may come after the stub: the student
meets it once the check has passed. A question's number (``answer_leaks``) is not printed, and
not written in the text, above the cell that asks for it. tests/test_exercise_leaks.py runs both
on every notebook's source; the notebooks' run (nbval, ``conftest.py`` at the repository's root)
runs them on their outputs as they are printed.
"""
from __future__ import annotations

import inspect
import re
import textwrap

from course_lib.exercises.sandbox import python_function

_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\d.])")  # 7.80 in "7.80x" too
MIN_KEY_LENGTH = 13  # shorter lines (``x = x + 1``) say too little to be an answer
_BARE_RETURN = re.compile(r"return [\w, ()]*$")  # ``return dq, dk, dv``: names, no answer


def _source(obj) -> str:
    return textwrap.dedent(inspect.getsource(python_function(obj)))


def _body(source: str) -> list[str]:
    """The lines of a function's body: its signature, however many lines, left out."""
    import ast

    tree = ast.parse(source)
    func = tree.body[0]
    first = func.body[0].lineno if func.body else len(source.splitlines()) + 1
    return source.splitlines()[first - 1:]


def key_lines(exercise) -> list[str]:
    """The stripped lines of the reference that the stub does not show: what the student must
    find (no signatures, decorators, comments, docstrings or returns of bare names)."""
    stub = {line.strip() for line in _source(exercise.stub).splitlines()}
    return [line.strip() for line in _body(_source(exercise.solution))
            if line.strip() and line.strip() not in stub and len(line.strip()) >= MIN_KEY_LENGTH
            and not line.strip().startswith(("def ", "@", "#", '"""', "'''"))
            and not _BARE_RETURN.match(line.strip())]


def stub_text(exercise) -> str:
    """The stub as the notebook shows it."""
    return _source(exercise.stub).strip()


def _stub_cell(cells, exercise) -> int | None:
    stub = stub_text(exercise)
    for i, (kind, source, _) in enumerate(cells):
        if kind == "code" and stub in source:
            return i
    return None


def leaks(lesson: str, cells, exercises=None, parts=("source", "output")) -> list[str]:
    """Where the key lines of ``lesson``'s exercises show before the student writes them.

    ``cells``: [(cell type, source, output text)] in notebook order (output "" where none).
    ``exercises``: {name: Exercise} (default: the catalogue's); ``parts``: where to look, the
    cells' "source", their "output" or both. Returns one line per leak."""
    if exercises is None:
        from course_lib.exercises import Exercise, catalogue

        exercises = {n: e for n, e in catalogue().items() if isinstance(e, Exercise)}
    mine = {n: e for n, e in exercises.items() if e.lesson == lesson}
    stubs = {n: _stub_cell(cells, e) for n, e in mine.items()}
    found = []
    for name, e in mine.items():
        at = stubs[name]
        if at is None:
            continue  # tests/test_exercises.py says the notebook lacks the stub
        keys = key_lines(e)
        for j, (kind, source, output) in enumerate(cells):
            where = (["source", "output"] if j < at
                     else ["source"] if j in stubs.values() and j != at else [])
            for part in (p for p in where if p in parts):
                text = source if part == "source" else output
                for line in keys:
                    if line in text:
                        found.append(f"{lesson}: cell {j} ({kind} {part}) shows a key line of "
                                     f"{name!r} (stub in cell {at}): {line!r}")
    return found


def hide(text: str, name: str) -> str:
    """``text`` (a printed kernel or function) with every line that holds a key line of exercise
    ``name`` replaced by ``...  # exercise name``: a lesson can show the code around an exercise
    before the student writes it."""
    from course_lib.exercises import catalogue

    keys = key_lines(catalogue()[name])
    out, hidden = [], False
    for line in text.splitlines():
        if any(k in line for k in keys):
            if not hidden:  # one marker for a run of hidden lines
                indent = line[:len(line) - len(line.lstrip())]
                out.append(f"{indent}...  # yours to write: exercise {name!r}")
            hidden = True
        else:
            out.append(line)
            hidden = False
    return "\n".join(out)


def _gives(token: str, value: float) -> bool:
    """Whether the printed number ``token`` is ``value`` rounded to the digits it shows, with at
    least three significant digits (a 4 or a 64 is no answer)."""
    digits = token.replace(",", "")
    if len(digits.replace(".", "").lstrip("0")) < 3:
        return False
    places = len(digits.split(".")[1]) if "." in digits else 0
    return abs(float(digits) - abs(value)) < 0.5 * 10.0 ** -places


def answer_leaks(lesson: str, cells, questions=None, parts=("source", "output")) -> list[str]:
    """Where the number a question of ``lesson`` asks for shows above the cell that asks it:
    in the text of a markdown cell or in a cell's printed output. ``cells`` as for ``leaks``;
    ``questions``: {name: Question} (default: the catalogue's)."""
    if questions is None:
        from course_lib.exercises import Question, catalogue

        questions = {n: q for n, q in catalogue().items() if isinstance(q, Question)}
    found = []
    for name, q in questions.items():
        if q.lesson != lesson or not q.value:
            continue
        at = next((i for i, (_, source, _) in enumerate(cells)  # a code cell, or the text
                   if f"'{name}'" in source or f'"{name}"' in source), None)  # that asks
        if at is None:
            continue  # asked nowhere in this notebook: nothing is above it
        for j, (kind, source, output) in enumerate(cells[:at]):
            texts = {"source": source if kind == "markdown" else "", "output": output}
            for part in parts:
                for token in _NUMBER.findall(texts[part]):
                    if _gives(token, q.value):
                        found.append(f"{lesson}: cell {j} ({kind} {part}) shows {token}, the "
                                     f"answer of {name!r} (asked in cell {at})")
    return found
