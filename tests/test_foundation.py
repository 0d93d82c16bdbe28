"""The foundation: device switch, first kernel, error messages, helpers."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import course_lib
from course_lib import exercises
from course_lib.kernels.vector_add import vector_add
from course_lib.testing import assert_close_2x, errors, fresh_randn, poison_

ROOT = Path(__file__).resolve().parents[1]


def test_switch_is_consistent():
    assert course_lib.DEVICE in ("cuda", "cpu")
    assert course_lib.INTERPRET == (course_lib.DEVICE == "cpu")
    assert (os.environ.get("TRITON_INTERPRET") == "1") == course_lib.INTERPRET
    if not torch.cuda.is_available():
        assert course_lib.DEVICE == "cpu"


def test_describe_prints_versions(capsys):
    info = course_lib.describe()
    out = capsys.readouterr().out
    for key in ("device", "mode", "gpu", "torch", "triton", "numpy"):
        assert key in info and key in out


def _run_python(code, **env):
    full = {**os.environ, **env}
    full.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=120)


def test_course_device_cpu_forces_interpreter():
    r = _run_python("import course_lib; print(course_lib.DEVICE, course_lib.INTERPRET)",
                    COURSE_DEVICE="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "True"]


def test_course_device_rejects_nonsense():
    r = _run_python("import course_lib", COURSE_DEVICE="tpu")
    assert r.returncode != 0 and "COURSE_DEVICE" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_course_device_cuda_without_gpu_is_an_error():
    r = _run_python("import course_lib", COURSE_DEVICE="cuda")
    assert r.returncode != 0 and "no CUDA device" in r.stderr


def test_nothing_else_touches_triton_interpret():
    offenders = []
    for path in list((ROOT / "course_lib").rglob("*.py")) + list((ROOT / "tests").rglob("*.py")):
        if path.name in ("_device.py", "test_foundation.py"):
            continue
        if "TRITON_INTERPRET" in path.read_text(encoding="utf-8"):
            offenders.append(str(path.relative_to(ROOT)))
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        if "TRITON_INTERPRET" in path.read_text(encoding="utf-8"):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"only course_lib/_device.py may read or set it: {offenders}"


@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vector_add(n, dtype):
    x, y = fresh_randn(n, dtype=dtype), fresh_randn(n, dtype=dtype)
    z = vector_add(x, y, block_size=256)
    torch.testing.assert_close(z, x + y)


def test_vector_add_errors_name_the_argument():
    x = fresh_randn(8)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        vector_add(x, [1.0] * 8)
    with pytest.raises(ValueError, match="x and y must have one shape"):
        vector_add(x, fresh_randn(9))
    with pytest.raises(TypeError, match="share a dtype"):
        vector_add(x, fresh_randn(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="power of two"):
        vector_add(x, x, block_size=100)


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    x = fresh_randn(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x is bfloat16"):
        vector_add(x, x)


@pytest.mark.gpu
def test_vector_add_on_gpu_bf16():
    x, y = (fresh_randn(1 << 20, dtype=torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(vector_add(x, y), x + y)


def test_testing_helpers():
    t = poison_(torch.empty(3))
    assert torch.isnan(t).all()
    ref = torch.tensor([1.0, float("-inf")])
    assert errors(torch.tensor([1.5, float("-inf")]), ref) == (0.5, 0.25)
    assert errors(torch.tensor([1.0, float("nan")]), ref)[0] == float("inf")
    assert_close_2x(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]),
                    torch.tensor([1.0, 2.0]), verbose=False)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_2x(torch.tensor([1.1]), torch.tensor([1.0]), torch.tensor([1.01]),
                        verbose=False)


def test_exercise_checker_hint_ladder_instead_of_crashing(capsys):
    """Before a first attempt only "not done yet" (no hint); a wrong attempt gets what is wrong
    (yours against expected) and the first rung; a right one passes."""
    def stub(x):
        raise NotImplementedError

    r = exercises.check("double", stub, lambda x: 2 * x, [(1.0,)], hints=("multiply by two",))
    out = capsys.readouterr().out
    assert not r and r.status == "todo" and "not done yet" in out
    assert "multiply by two" not in out
    r = exercises.check("double", lambda x: x + 1, lambda x: 2 * x, [(3.0,)],
                        hints=("multiply by two",))
    assert not r and r.status == "wrong"
    assert "yours" in r.message and "expected" in r.message and "multiply by two" in r.message
    assert exercises.check("double", lambda x: x * 2, lambda x: 2 * x, [(3.0,)], hints=("h",))


def test_readme_quick_start_is_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quick start.*?```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README needs a '## Quick start' section with a code block"
    commands = [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
    assert [c.split("#")[0].strip() for c in commands] == ["./course lab", "./course test"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "./course test" in ci


def test_lesson_map_matches_notebooks_and_readme():
    from course_lib.lessons import LESSONS

    on_disk = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    listed = {lesson.notebook for lesson in LESSONS}
    assert on_disk == listed, (f"not in lessons.py: {sorted(on_disk - listed)}; "
                               f"no notebook: {sorted(listed - on_disk)}")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for lesson in LESSONS:
        assert f"(notebooks/{lesson.notebook}.ipynb)" in readme, lesson.notebook
        if lesson.deck:
            assert f"(slides/{lesson.deck}.md)" in readme, lesson.deck
