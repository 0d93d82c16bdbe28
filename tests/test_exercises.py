"""The exercise catalogue (course_lib.exercises): students write the kernels, checkers teach.

- every reference solution passes its checker, every registered wrong answer fails it with the
  message a student would see, every stub reads as "not done yet" (``verify``);
- a Triton exercise is a kernel the student writes: at least ten, one in every kernel lesson;
  a pure-PyTorch answer is refused; a kernel that reads or writes outside its tensors gets a
  message and the process lives on;
- the notebook shows exactly the registered stub, and a notebook run with its stubs prints no
  solution and none of its key lines; no notebook calls hint, solution or answer;
- every think-question of a notebook has a worked answer the student can reveal.
"""
import contextlib
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib import exercises as ex
from course_lib.exercises.__main__ import verify_one
from course_lib.exercises.sandbox import python_function

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ex.catalogue()
EXERCISES = {n: e for n, e in CATALOGUE.items() if isinstance(e, ex.Exercise)}
QUESTIONS = {n: e for n, e in CATALOGUE.items() if isinstance(e, ex.Question)}
KERNEL_LESSONS = ("00_setup", "02b_triton_puzzles", "03_tiled_matmul", "07_triton_flash_v1",
                  "08_triton_flash_v2", "10_backward", "12_flash_decoding", "13_paged_attention",
                  "15_attention_variants")


def code_cells(lesson: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def markdown_cells(lesson: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def source(obj) -> str:
    import inspect

    return textwrap.dedent(inspect.getsource(python_function(obj)))


def key_lines(e) -> list[str]:
    """The lines of the reference that the stub leaves blank: what the student must find."""
    stub = {line.strip() for line in source(e.stub).splitlines()}
    return [line.strip() for line in source(e.solution).splitlines()
            if line.strip() and line.strip() not in stub and len(line.strip()) > 12
            and not line.strip().startswith(("def ", "@", "#", '"""', "return"))]


def test_triton_exercises_in_every_kernel_lesson():
    triton = [e for e in EXERCISES.values() if e.kind == "triton"]
    assert len(triton) >= 10, f"{len(triton)} Triton exercises: {[e.name for e in triton]}"
    missing = [lesson for lesson in KERNEL_LESSONS if not any(e.lesson == lesson for e in triton)]
    assert not missing, f"kernel lessons without a Triton exercise: {missing}"


MAIN_EXERCISES = {"07_triton_flash_v1": "flash_v1_kernel", "08_triton_flash_v2":
                  "flash_v2_causal_kernel", "10_backward": "dkdv_kernel",
                  "12_flash_decoding": "split_kv"}


def written_lines(e) -> int:
    """The lines of the solution that the stub does not show (comments and headers aside)."""
    stub = {line.strip() for line in source(e.stub).splitlines()}
    lines = [line.strip() for line in source(e.solution).splitlines()]
    return sum(1 for line in lines if line and line not in stub
               and not line.startswith(("#", '"""', "def ", "@")))


def test_the_student_writes_whole_kernels():
    """At least 20 Triton exercises; the main exercise of 07, 08, 10 and 12 is a kernel's loop
    body of 10 lines or more; no exercise states more lines than its solution adds to its stub."""
    triton = [e for e in EXERCISES.values() if e.kind == "triton"]
    assert len(triton) >= 20, f"{len(triton)} Triton exercises"
    for lesson, name in MAIN_EXERCISES.items():
        e = EXERCISES[name]
        assert e.lesson == lesson and e.kind == "triton" and e.lines >= 10, (name, e.lines)
    overstated = [(n, e.lines, written_lines(e)) for n, e in EXERCISES.items()
                  if e.lines > written_lines(e) + 1]
    assert not overstated, f"(name, lines stated, lines the solution adds): {overstated}"


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_verify(name):
    problems = verify_one(CATALOGUE[name])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_notebook_shows_the_registered_stub(name):
    e = EXERCISES[name]
    stub = source(e.stub).strip()
    cells = code_cells(e.lesson)
    assert any(stub in cell for cell in cells), \
        f"notebooks/{e.lesson}.ipynb has no cell with the stub of {name}:\n{stub}"


@pytest.mark.parametrize("name", list(EXERCISES))
def test_stub_run_and_hints_never_give_the_answer(name):
    e = EXERCISES[name]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = e.check(e.stub)
    assert result.status == "todo"
    printed = out.getvalue()
    assert "not done yet" in printed and "Nudge" not in printed and "hint" not in printed
    for line in key_lines(e):
        assert line not in printed, f"{name}: a stub run prints the key line {line!r}"
        for h in e.hints:
            assert line not in h, f"{name}: a hint contains the key line {line!r}"


@pytest.mark.parametrize("lesson", sorted({e.lesson for e in CATALOGUE.values()}))
def test_notebooks_never_reveal(lesson):
    for cell in code_cells(lesson):
        for call in ("solution(", "hint(", "answer("):
            assert not re.search(rf"(^|[^\w.]){re.escape(call)}", cell, re.M), \
                f"notebooks/{lesson}.ipynb calls {call}...) in a code cell:\n{cell[:300]}"


def test_think_questions_have_answers():
    """Every 'to think about' of a notebook names the question whose answer it reveals."""
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    missing = []
    for lesson in lessons:
        for cell in markdown_cells(lesson):
            for block in re.split(r"\n(?=\*\*)", cell):
                if re.search(r"to think about|\(thinking\)|\bthink\b\.?\*\*", block, re.I):
                    names = re.findall(r"answer\(['\"]([\w.]+)['\"]\)", block)
                    if not names or any(n not in QUESTIONS for n in names):
                        missing.append(f"{lesson}: {block[:80]!r}")
    assert not missing, "think-questions without a registered answer:\n" + "\n".join(missing)


def test_a_pure_torch_answer_to_a_triton_exercise_is_refused():
    from course_lib.exercises.setup import check_bias_rows

    result = check_bias_rows(lambda x, b: x + b, show=False)
    assert not result and result.status == "wrong"
    assert "@triton.jit kernel" in result.message and "does not count" in result.message


def test_an_out_of_bounds_kernel_leaves_the_process_alive():
    """A mask that lets lanes past the edge through, run by the checker in a fresh process: a
    message, exit 0."""
    code = ("from course_lib.exercises import setup as s\n"
            "r = s.check_bias_rows(s._rows_mask_only)\n"
            "print('STATUS', r.status)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "out of bounds" in proc.stdout and "STATUS wrong" in proc.stdout
    assert "Check the mask" in proc.stdout


def test_hint_ladder_and_solution(capsys):
    name = next(iter(EXERCISES))
    e = EXERCISES[name]
    ex._HINTS_SHOWN.pop(name, None)
    for level in range(len(e.hints)):
        assert ex.hint(name) is None  # printed once: a returned string would show again
        assert f"hint {level + 1} of {len(e.hints)}" in capsys.readouterr().out
    ex.hint(name)
    assert f"solution('{name}')" in capsys.readouterr().out
    ex.solution(name)
    assert source(e.solution).splitlines()[1].strip() in capsys.readouterr().out


def test_list_command():
    proc = subprocess.run([sys.executable, "-m", "course_lib.exercises", "list"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(CATALOGUE)
    for line, (name, e) in zip(lines, CATALOGUE.items()):
        assert line.split()[:3] == [e.lesson, name, e.kind]


def test_a_registered_mistake_is_named_by_its_signature():
    """A wrong answer whose outputs are a registered mistake's on the failing case is told
    which mistake it is, not the ladder's first rung (here 08's e^x where scores are base 2)."""
    e = EXERCISES["flash_v2_kernel"]
    wrong = next(m for m in e.mistakes if m.label == "exp for exp2")
    result = e.check(wrong.answer, show=False)
    assert not result and "Diagnosis" in result.message and "exp for exp2" in result.message
    assert e.hints[0] not in result.message
