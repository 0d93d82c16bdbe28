"""The notebooks' run (nbval): no exercise's answer is printed above its stub, and no question's
number above the cell that asks for it.

While nbval runs a notebook cell by cell, each cell's printed output is kept; at the last code
cell, ``course_lib.exercises.leaks`` looks for the key lines of the notebook's exercises in the
outputs of the cells above each stub (a kernel printed by ``inspect.getsource`` above its
exercise gives the answer away). A leak fails that last cell, naming the cell and the line.
tests/test_exercise_leaks.py checks the notebooks' sources the same way.

A kernel that dies before it answers its first message is started once more: jupyter_client
picks a free port, closes it and hands it to the new kernel, and with several notebooks running
side by side another connection can take that port in between (one notebook lost all its cells
that way in four full runs of ``./course gpu-check``). No cell of the notebook has run then.
"""
from pathlib import Path

import pytest

_OUTPUTS: dict = {}  # notebook path -> {cell index: printed text}


def pytest_configure(config):
    try:
        import nbval.kernel
    except ImportError:
        return
    start = nbval.kernel.start_new_kernel

    def start_new_kernel(*args, **kwargs):
        try:
            return start(*args, **kwargs)
        except RuntimeError:  # "Kernel died before replying to kernel_info": its port was taken
            return start(*args, **kwargs)

    nbval.kernel.start_new_kernel = start_new_kernel


def _printed(outputs) -> str:
    parts = []
    for out in outputs or ():
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    nb = getattr(item.parent, "nb", None)
    if call.when != "call" or nb is None or not hasattr(item, "test_outputs"):
        return  # not the run of a notebook cell by nbval
    path = str(item.parent.path)
    index = next(i for i, c in enumerate(nb.cells) if c is item.cell)
    _OUTPUTS.setdefault(path, {})[index] = _printed(item.test_outputs)
    last = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    if index != last:
        return
    from course_lib.exercises.leaks import answer_leaks, leaks

    printed = _OUTPUTS.pop(path)
    cells = [(c.cell_type, c.source, printed.get(i, "")) for i, c in enumerate(nb.cells)]
    found = (leaks(Path(path).stem, cells, parts=("output",))
             + answer_leaks(Path(path).stem, cells, parts=("output",)))
    report = outcome.get_result()
    if found and report.passed:
        report.outcome = "failed"
        report.longrepr = ("a cell printed an exercise's answer above its stub:\n"
                           + "\n".join(found))
