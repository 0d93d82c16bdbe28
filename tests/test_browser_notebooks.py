"""Every lesson as a student meets it: JupyterLab in headless Chromium, Run All Cells.

For each notebook: every code cell runs, and the page shows no error, no warning box (stderr),
and no figure printed as text (``<Figure size ...>``) instead of drawn; every figure a cell
makes is an image on the page. Markdown images (../images/*.png) load. A canary notebook with
each fault proves the harness sees them. Same set-up and skips as tests/test_browser_widgets.py
(Playwright and Debian's Chromium).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from course_lib import browser

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
RUN_TIMEOUT_MS = 600_000
WHY_NOT = browser.why_no_browser()
CANARY = "zz_faults_canary.ipynb"


def _write_canary(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(
        "import warnings\nimport matplotlib.pyplot as plt\n"
        "from matplotlib.figure import Figure\n"
        "warnings.warn('a warning box')\n"
        "fig = Figure(); fig.subplots().plot([1, 2])\nfig")]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if WHY_NOT:
        pytest.skip(f"browser test skipped: {WHY_NOT}")
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copytree(ROOT / "images", root / "images")  # markdown links ../images/x.png
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    _write_canary(root / "notebooks" / CANARY)
    # Rooted where the student's server is (./course lab): the repository, so that the
    # notebooks' ../images/ links resolve.
    with browser.JupyterLab(root, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def chromium(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = browser.launch_chromium(p)
        try:
            yield b
        finally:
            b.close()


def _run(lab, chromium, name):
    context = chromium.new_context(viewport={"width": 1400, "height": 1400})
    page = context.new_page()
    try:
        browser.open_notebook(page, lab, f"notebooks/{name}")
        prompts = browser.run_all_cells(page, timeout_ms=RUN_TIMEOUT_MS)
        problems = browser.output_problems(page)
        images = browser.drawn_images(page)
        markdown_images = page.evaluate(
            """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) '
                      + '.jp-MarkdownOutput img')].map(i => [i.getAttribute('src'),
                      i.complete && i.naturalWidth > 0])""")
        return prompts, problems, images, markdown_images
    finally:
        lab.shutdown_kernels()
        context.close()


def test_the_harness_sees_warnings_and_undrawn_figures(lab, chromium):
    _, problems, _, _ = _run(lab, chromium, CANARY)
    assert any("a warning box" in w for w in problems["warning"]), problems
    assert problems["undrawn figure"], problems


def _figure_cells(name: str) -> int:
    """Code cells that make a figure for the student to see (show(...), display(...) of a
    figure or a plot_* call), counted from the source."""
    import json

    nb = json.loads((ROOT / "notebooks" / name).read_text())
    pattern = re.compile(r"^(show\(|display\(.*(plot|fig|figure)|\w+\.plot_\w+\(|"
                         r"plt\.show\(\))", re.M)  # top-level calls, not a helper's body
    return sum(1 for c in nb["cells"] if c["cell_type"] == "code"
               and pattern.search("".join(c["source"])))


@pytest.mark.parametrize("name", NOTEBOOKS, ids=[n.removesuffix(".ipynb") for n in NOTEBOOKS])
def test_notebook_runs_clean_in_jupyterlab(name, lab, chromium):
    prompts, problems, images, markdown_images = _run(lab, chromium, name)
    not_run = [i for i, t in enumerate(prompts) if not re.search(r"\[\d+\]", t)]
    assert not not_run, f"{name}: code cells {not_run} did not run"
    shown = {k: v for k, v in problems.items() if v}
    assert not shown, f"{name} shows:\n" + "\n".join(f"{k}: {v}" for k, v in shown.items())
    broken = [src for src, ok in markdown_images if not ok]
    assert not broken, f"{name}: markdown images that do not load: {broken}"
    assert images >= _figure_cells(name), \
        f"{name}: {images} images drawn, but {_figure_cells(name)} cells make a figure"
