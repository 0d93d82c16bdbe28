"""The house a newcomer walks (ARCHITECTURE.md): kernels/ holds kernels, layers are kept.

- every file in course_lib/kernels/ holds @triton.jit code (lesson helpers live elsewhere), and
  stays readable in one sitting;
- the import-linter contract of pyproject.toml holds: the layers, and no cycles anywhere;
- the public API is in one place, course_lib.ops.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p for p in (ROOT / "course_lib" / "kernels").glob("*.py")
                 if p.name != "__init__.py")


@pytest.mark.parametrize("path", KERNELS, ids=[p.name for p in KERNELS])
def test_every_kernel_file_holds_triton_code(path):
    text = path.read_text()
    assert "@triton.jit" in text, f"{path.name} has no @triton.jit function: not a kernel file"
    assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines"
    doc = text[:text.index('"""', 3)]
    assert re.search(r"notebooks/\d\d[a-z]?_\w+\.ipynb", doc), f"{path.name}: no lesson named"


@pytest.mark.parametrize("path", [p for p in KERNELS if p.name != "attention_common.py"],
                         ids=lambda p: p.name)
def test_kernel_docstrings_state_their_speed_or_say_none(path):
    doc = path.read_text()[:path.read_text().index('"""', 3)]
    measured = re.search(r"Speed on NVIDIA|TFLOP/s|µs", doc)
    assert measured or "not benchmarked" in doc, f"{path.name}: no measured speed"


def test_layers_and_no_cycles():
    pytest.importorskip("importlinter")
    code = ("import sys; from importlinter.cli import lint_imports_command as c; "
            "sys.argv[1:] = ['--no-cache']; sys.exit(c())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_public_api_in_one_place():
    from course_lib import ops

    for name in ("flash_attn_v1", "flash_attn_v2", "flash_decode", "paged_decode", "matmul",
                 "vector_add"):
        assert callable(getattr(ops, name)), name
