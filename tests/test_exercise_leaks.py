"""No exercise's answer is on the page before the student writes it (course_lib.exercises.leaks):
its key lines appear in no cell above its stub and in no other exercise's skeleton. The
notebooks' outputs get the same check while nbval runs them (the repository's conftest.py)."""
import json
from pathlib import Path

import pytest

from course_lib.exercises import Exercise, catalogue
from course_lib.exercises.leaks import answer_leaks, key_lines, leaks

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = {n: e for n, e in catalogue().items() if isinstance(e, Exercise)}


def cells(lesson: str):
    nb = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())
    return [(c["cell_type"], "".join(c["source"]), "") for c in nb["cells"]]


@pytest.mark.parametrize("lesson", sorted({e.lesson for e in EXERCISES.values()}))
def test_no_answer_above_its_exercise(lesson):
    found = leaks(lesson, cells(lesson), EXERCISES)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("lesson", sorted({q.lesson for q in catalogue().values()
                                           if not isinstance(q, Exercise)}))
def test_no_question_answered_above_it(lesson):
    """No markdown cell above a question writes the number it asks for."""
    found = answer_leaks(lesson, cells(lesson), parts=("source",))
    assert not found, "\n".join(found)


def test_a_printed_number_is_found():
    """The answer rounded to the digits printed counts; a number of two digits does not."""
    from course_lib.exercises import Question

    q = Question("q_test", "00_setup", "asks", "answer", value=7.8027)
    page = [("code", "", "ceiling 7.80x, 64 tiles, 8.0"), ("code", "check_answer('q_test', x)", "")]
    found = answer_leaks("00_setup", page, {"q_test": q})
    assert len(found) == 1 and "shows 7.80" in found[0]


def test_every_exercise_has_key_lines():
    """An exercise whose stub already shows every line of its answer teaches nothing."""
    empty = [n for n, e in EXERCISES.items() if not key_lines(e)]
    assert not empty, f"exercises with nothing left to write: {empty}"


def test_a_printed_answer_is_found():
    """The check sees a key line in the output of a cell above the stub, and in a later
    skeleton; it lets the library's version after the stub be."""
    name, e = next((n, e) for n, e in EXERCISES.items() if e.lesson == "00_setup")
    from course_lib.exercises.leaks import stub_text

    line = key_lines(e)[0]
    page = [("code", "print(source)", f"...\n    {line}\n"), ("code", stub_text(e), ""),
            ("code", "show(library_version)", f"{line}\n")]
    found = leaks("00_setup", page, {name: e})
    assert len(found) == 1 and "cell 0 (code output)" in found[0]
