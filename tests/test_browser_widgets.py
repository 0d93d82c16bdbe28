"""The course's widgets in a real browser: JupyterLab on localhost, headless Chromium.

For each widget notebook: open it in JupyterLab, Run → Run All Cells, wait until every cell has
run, check that no error shows in the page, then move every slider of every widget with the
keyboard (as a student would: focus the handle, press →) and check that the widget's drawing
changes: screenshots of its picture before and after must differ. Screenshots are kept in
``$COURSE_SCREENSHOTS`` (default ``<tmp>/course-browser-screenshots``).

The notebooks run from a temporary copy, so nothing is written into notebooks/.

Needs the ``playwright`` Python package and a Chromium (Debian/Ubuntu:
``apt-get install -y chromium``; Playwright's own browser download is not used). Where either is
missing, every test here is skipped with that reason.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from course_lib import browser

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
WIDGET_NOTEBOOKS = [
    "01_softmax.ipynb",             # online softmax, step by step
    "03_tiled_matmul.ipynb",        # the tiled matmul's tiles and HBM reads
    "06_flash_v1_algorithm.ipynb",  # the tile walk
    "12_flash_decoding.ipynb",      # split-KV and the LSE merge
    "15_attention_variants.ipynb",  # the block map of attention's variants
]
SHOTS = Path(os.environ.get("COURSE_SCREENSHOTS",
                            Path(tempfile.gettempdir()) / "course-browser-screenshots"))
RUN_TIMEOUT_MS = 150_000  # Run All Cells of one notebook
REDRAW_TIMEOUT_S = 30  # one slider move until the new picture shows
WHY_NOT = browser.why_no_browser()


CANARY = "zz_browser_canary.ipynb"


def _write_canary(path: Path) -> None:
    """A notebook the harness must fail on: a slider that redraws nothing, then an error."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# canary"),
        nbformat.v4.new_code_cell(
            "import ipywidgets as w\n"
            "s = w.IntSlider(value=1, min=0, max=5, description='frozen')\n"
            "out = w.Output()\n"
            "with out:\n"
            "    print('this picture never changes')\n"
            "w.VBox([s, out])"),
        nbformat.v4.new_code_cell("1 / 0"),
        nbformat.v4.new_code_cell("print('never runs')"),
    ]
    nbformat.write(nb, path)


def _params():
    for name in WIDGET_NOTEBOOKS:
        marks = []
        if not (ROOT / "notebooks" / name).exists():
            marks.append(pytest.mark.skip(reason=f"notebooks/{name} does not exist yet"))
        yield pytest.param(name, marks=marks, id=name.removesuffix(".ipynb"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if WHY_NOT:
        pytest.skip(f"browser test skipped: {WHY_NOT}")
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    # course_lib imports from the repository even where it is not pip-installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    _write_canary(root / "notebooks" / CANARY)
    with browser.JupyterLab(root / "notebooks", env=env) as server:
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


def _wait_for_picture(drawings, differs_from=None):
    """Settled screenshots of the drawings, polled until they differ from ``differs_from`` or
    REDRAW_TIMEOUT_S passes; returns the last ones."""
    deadline = time.time() + REDRAW_TIMEOUT_S
    while True:
        shots = browser.settled_screenshots(drawings)
        if differs_from is None or shots != differs_from or time.time() > deadline:
            return shots
        time.sleep(0.2)


@pytest.mark.parametrize("name", list(_params()))
def test_widgets_redraw_in_the_browser(name, lab, chromium):
    out_dir = SHOTS / name.removesuffix(".ipynb")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    context = chromium.new_context(viewport={"width": 1400, "height": 1400})
    page = context.new_page()
    js_errors = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    try:
        browser.open_notebook(page, lab, name)
        prompts = browser.run_all_cells(page, timeout_ms=RUN_TIMEOUT_MS)
        errors = browser.page_errors(page)
        assert not errors, f"{name} shows errors after Run All Cells:\n" + "\n".join(errors)
        not_run = [i for i, t in enumerate(prompts) if not re.search(r"\[\d+\]", t)]
        assert not not_run, f"{name}: code cells {not_run} did not run (prompts {prompts})"

        roots = browser.widget_roots(page)
        assert roots, f"{name}: no widget with a slider was displayed"
        moved = []
        page.screenshot(path=str(out_dir / "page-after-run-all.png"))
        for w, root in enumerate(roots):
            root.scroll_into_view_if_needed()
            drawings = browser.widget_drawings(root)
            assert drawings, f"{name}: widget {w} has sliders but no picture"
            for label, handle, readout in browser.slider_handles(root):
                before = _wait_for_picture(drawings)
                old, new, back = browser.move_slider(handle, readout)
                assert old != new, f"{name}: slider {label!r} did not move (readout {old})"
                after = _wait_for_picture(drawings, differs_from=before)
                tag = f"w{w}-{label or 'slider'}".replace(" ", "_").replace("/", "_")
                for i, (b, a) in enumerate(zip(before, after)):
                    (out_dir / f"{tag}-{i}-before.png").write_bytes(b)
                    (out_dir / f"{tag}-{i}-after.png").write_bytes(a)
                assert after != before, (
                    f"{name}: moving {label!r} from {old} to {new} did not change the drawing "
                    f"within {REDRAW_TIMEOUT_S} s (screenshots in {out_dir})")
                browser.wait_kernel_idle(page, RUN_TIMEOUT_MS)
                # Back where it was, so the next slider starts from the notebook's state (not
                # always the same picture: a slider may clamp another, as tile T clamps step).
                browser.press_until_changed(handle, readout, back)
                browser.wait_kernel_idle(page, RUN_TIMEOUT_MS)
                moved.append(f"{label}: {old} -> {new} -> {old}")
        errors = browser.page_errors(page)
        assert not errors, f"{name} shows errors after moving the sliders:\n" + "\n".join(errors)
        assert not js_errors, f"{name}: uncaught errors in the page:\n" + "\n".join(js_errors)
        print(f"{name}: moved {len(moved)} sliders ({'; '.join(moved)}); screenshots in "
              f"{out_dir}")
    finally:
        try:
            page.screenshot(path=str(out_dir / "page.png"), full_page=True)
        except Exception as e:  # the page may be gone: keep the test's own error
            print(f"no final screenshot: {e}")
        context.close()


def test_the_harness_sees_errors_and_frozen_drawings(lab, chromium):
    """The checks above can fail: on a canary notebook the traceback is found, the cells after
    it are reported as not run, and a slider that redraws nothing leaves the picture as it was."""
    context = chromium.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    try:
        browser.open_notebook(page, lab, CANARY)
        prompts = browser.run_all_cells(page, timeout_ms=60_000)
        errors = browser.page_errors(page)
        assert any("ZeroDivisionError" in e for e in errors), errors
        ran = [bool(re.search(r"\[\d+\]", t)) for t in prompts]
        assert ran == [True, True, False], prompts
        (root,) = browser.widget_roots(page)
        drawings = browser.widget_drawings(root)
        before = browser.settled_screenshots(drawings)
        ((label, handle, readout),) = browser.slider_handles(root)
        old, new, _ = browser.move_slider(handle, readout)
        assert (label, old, new) == ("frozen", "1", "2")
        time.sleep(1.0)
        assert browser.settled_screenshots(drawings) == before
    finally:
        context.close()


def test_setup_notebook_runs_top_to_bottom_in_jupyterlab(lab, chromium):
    """The first lesson, as a student meets it: opened in JupyterLab, Run All Cells, no error,
    every code cell ran, and the device report of course_lib.describe() is on the page."""
    context = chromium.new_context(viewport={"width": 1400, "height": 1400})
    page = context.new_page()
    try:
        browser.open_notebook(page, lab, "00_setup.ipynb")
        prompts = browser.run_all_cells(page, timeout_ms=RUN_TIMEOUT_MS)
        errors = browser.page_errors(page)
        assert not errors, "00_setup shows errors after Run All Cells:\n" + "\n".join(errors)
        not_run = [i for i, t in enumerate(prompts) if not re.search(r"\[\d+\]", t)]
        assert not not_run, f"00_setup: code cells {not_run} did not run (prompts {prompts})"
        text = page.inner_text(".jp-NotebookPanel:not(.lm-mod-hidden)")
        assert "Triton interpreter" in text or "compiled Triton" in text
        assert "bias_rows" in text  # the exercise check printed its hint instead of crashing
    finally:
        context.close()
