"""Drive the course's notebooks in a real browser: JupyterLab on localhost, headless Chromium.

Used by tests/test_browser_widgets.py, which opens each widget notebook, runs it, moves every
slider and checks that the drawing changes (screenshots differ) and that no error shows.

* ``JupyterLab``: a context manager that starts ``python -m jupyter lab`` on a free port with
  a random token, fresh settings (no news pop-ups, no virtualised notebook windowing, so every
  cell is in the page), waits until it answers, and stops it (its whole process group).
* ``launch_chromium``: Playwright driving the system's Chromium (Debian's ``chromium``
  package: Playwright's own browser download is not needed), headless, sandbox off (containers
  run as root), no network services.
* ``open_notebook``, ``run_all_cells``, ``widget_roots``, ``widget_drawings``,
  ``slider_handles``, ``move_slider``, ``page_errors``: the steps a student takes, and what
  they look at, in Playwright.

Nothing here is imported by the lessons; playwright is a test dependency only.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser",
                       "/usr/bin/google-chrome")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]

# JupyterLab settings for a quiet, deterministic page: every cell rendered (no windowing), the
# notebook's kernel started without asking, nothing saved, no news or update toasts.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def find_chromium() -> str | None:
    """Path of a Chromium (or Chrome) executable, or None."""
    for path in CHROMIUM_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def why_no_browser() -> str | None:
    """None when the browser test can run; otherwise the reason it cannot."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if find_chromium() is None:
        return ("no Chromium found (Debian/Ubuntu: apt-get install -y chromium); "
                "looked in " + ", ".join(CHROMIUM_CANDIDATES))
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """``with JupyterLab(root_dir) as lab: page.goto(lab.url("lab/tree/x.ipynb"))``."""

    def __init__(self, root_dir, python: str = sys.executable, timeout_s: float = 90,
                 env: dict | None = None):
        self.root_dir = Path(root_dir)
        self.python = python
        self.timeout_s = timeout_s
        self.env = env
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.proc = None
        self._tmp = None
        self.log_path = None

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={self.token}"

    def __enter__(self) -> JupyterLab:
        self._tmp = tempfile.TemporaryDirectory(prefix="course-lab-")
        tmp = Path(self._tmp.name)
        settings = tmp / "settings"
        for name, value in LAB_SETTINGS.items():
            plugin, file = name.rsplit("/", 1)
            (settings / plugin).mkdir(parents=True, exist_ok=True)
            (settings / plugin / file).write_text(json.dumps(value))
        (tmp / "workspaces").mkdir()
        self.log_path = tmp / "lab.log"
        env = dict(os.environ if self.env is None else self.env)
        env.pop("MPLBACKEND", None)  # the kernel's inline backend draws the figures
        env["JUPYTER_CONFIG_DIR"] = str(tmp / "config")  # no user config
        cmd = [self.python, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root_dir}",
               f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
               ]
        if hasattr(os, "getuid") and os.getuid() == 0:
            cmd.append("--allow-root")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root_dir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n"
                                   + self.log())
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.time() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"JupyterLab did not answer in {self.timeout_s:.0f} s:\n"
                                   + self.log())
            time.sleep(0.5)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def shutdown_kernels(self) -> None:
        """Stop every kernel the server started (kernels run in sessions of their own)."""
        try:
            with urllib.request.urlopen(self.url("api/kernels"), timeout=5) as r:
                kernels = json.load(r)
            for k in kernels:
                req = urllib.request.Request(self.url(f"api/kernels/{k['id']}"), method="DELETE")
                urllib.request.urlopen(req, timeout=10).close()
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.shutdown_kernels()
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def launch_chromium(playwright, executable_path: str | None = None):
    """Headless Chromium through Playwright, with a fresh profile (Playwright's default)."""
    return playwright.chromium.launch(executable_path=executable_path or find_chromium(),
                                      headless=True, args=CHROMIUM_ARGS)


# ---------------------------------------------------------------------------------------------
# what a student does, in Playwright
# ---------------------------------------------------------------------------------------------

def open_notebook(page, lab: JupyterLab, name: str, timeout_ms: float = 60_000) -> None:
    """Open ``name`` (relative to the server's root) and wait until its kernel is idle."""
    page.goto(lab.url(f"lab/tree/{name}?reset"))  # reset: no tabs restored from a workspace
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=timeout_ms)
    wait_kernel_idle(page, timeout_ms)


def wait_kernel_idle(page, timeout_ms: float) -> None:
    """Wait until the notebook's kernel is started and idle: the status bar reads
    "<kernel name> | Idle" (before the kernel is up it reads "No Kernel | Initializing")."""
    page.wait_for_function(
        """() => {
            const items = [...document.querySelectorAll(
                '#jp-main-statusbar .jp-StatusBar-TextItem[title^="Change kernel"]')];
            const ind = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                                               + '.jp-Notebook-ExecutionIndicator');
            return items.some(e => /\\| Idle$/.test(e.textContent.trim())
                                   && !/^No Kernel/.test(e.textContent.trim()))
                && (!ind || ind.getAttribute('data-status') === 'idle');
        }""", timeout=timeout_ms)


_PROMPTS = "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) " \
           ".jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim())"


def run_all_cells(page, timeout_ms: float = 120_000) -> list[str]:
    """Run → Run All Cells from the menu bar; wait until no cell is queued or running.

    Returns the prompts of the code cells (``[n]:`` once run; a cell after an error stays
    ``[ ]:``, so the caller can tell which cells never ran).
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                     has_text="Run All Cells").first.click()
        try:  # the click took: some prompt reads [*] (queued or running) or [n] (done)
            page.wait_for_function(
                f"() => ({_PROMPTS})().some(t => /\\[(\\*|\\d+)\\]/.test(t))",
                timeout=15_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
            page.keyboard.press("Escape")  # close a menu left open, then try again
    page.wait_for_function(f"() => !({_PROMPTS})().some(t => t.includes('[*]'))",
                           timeout=timeout_ms)
    wait_kernel_idle(page, timeout_ms)
    return page.evaluate(_PROMPTS)


def widget_roots(page):
    """Locators of the top-level widget views (one per cell output) that contain a slider."""
    roots = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell-outputArea "
                         "> .jp-OutputArea-child > .jp-OutputArea-output > .jupyter-widgets")
    return [roots.nth(i) for i in range(roots.count())
            if roots.nth(i).locator(".widget-slider").count()]


def widget_drawings(root):
    """The parts of a widget that draw: Output widgets (matplotlib figures), Image widgets."""
    found = root.locator(".widget-output, .widget-image")
    return [found.nth(i) for i in range(found.count())]


def images_loaded(root) -> bool:
    """True when every <img> inside ``root`` has finished loading and decoding."""
    return root.evaluate(
        "el => [...el.querySelectorAll('img')].every(i => i.complete && i.naturalWidth > 0)")


def settled_screenshots(drawings, timeout_s: float = 10.0) -> tuple[bytes, ...]:
    """Screenshots of ``drawings`` once their images have loaded and two shots in a row agree."""
    deadline = time.time() + timeout_s
    last = None
    while True:
        if all(images_loaded(d) for d in drawings):
            now = tuple(d.screenshot(animations="disabled") for d in drawings)
            if now == last or time.time() > deadline:
                return now
            last = now
        elif time.time() > deadline:
            return tuple(d.screenshot(animations="disabled") for d in drawings)
        time.sleep(0.25)


def slider_handles(root):
    """(description, handle locator, readout locator) of every slider inside ``root``."""
    sliders = root.locator(".widget-slider")
    out = []
    for i in range(sliders.count()):
        s = sliders.nth(i)
        label = s.locator(".widget-label").first.inner_text().strip()
        out.append((label, s.locator(".noUi-handle").first, s.locator(".widget-readout").first))
    return out


def slider_range(handle) -> tuple[float, float, float]:
    """(min, value, max) of a slider, from its handle's ARIA attributes (noUiSlider)."""
    return tuple(float(handle.get_attribute(a))
                 for a in ("aria-valuemin", "aria-valuenow", "aria-valuemax"))


def press_until_changed(handle, readout, key: str, timeout_s: float = 5.0) -> tuple[str, str]:
    """Focus the slider's handle, press ``key``; return the readout before and after."""
    before = readout.inner_text().strip()
    handle.focus()
    handle.press(key)
    deadline = time.time() + timeout_s
    after = readout.inner_text().strip()
    while after == before and time.time() < deadline:
        time.sleep(0.05)
        after = readout.inner_text().strip()
    return before, after


def move_slider(handle, readout) -> tuple[str, str, str]:
    """One keyboard step of a slider: → unless it is at its maximum, then ←.

    Returns (readout before, readout after, the key that moves it back).
    """
    lo, value, hi = slider_range(handle)
    key, back = ("ArrowRight", "ArrowLeft") if value < hi else ("ArrowLeft", "ArrowRight")
    before, after = press_until_changed(handle, readout, key)
    return before, after, back


def page_errors(page) -> list[str]:
    """Errors visible in the page: tracebacks in outputs, widget failures, error dialogs."""
    return page.evaluate(
        """() => {
            const found = [];
            const panel = '.jp-NotebookPanel:not(.lm-mod-hidden) ';
            const stderr = '[data-mime-type="application/vnd.jupyter.stderr"]';
            for (const el of document.querySelectorAll(panel + '.jp-OutputArea-output' + stderr)) {
                const t = el.textContent;
                if (/Traceback|Error\\b|Exception\\b/.test(t)) {
                    found.push('stderr: ' + t.slice(0, 800));
                }
            }
            for (const el of document.querySelectorAll(panel + '.jp-OutputArea-output')) {
                const t = el.textContent;
                if (/Error displaying widget|Failed to load model class|model not found/.test(t))
                    found.push('widget: ' + t.slice(0, 300));
            }
            for (const el of document.querySelectorAll('.jp-Dialog')) {
                found.push('dialog: ' + el.textContent.slice(0, 300));
            }
            return found;
        }""")


def output_problems(page) -> dict[str, list[str]]:
    """What a student should not see in the open notebook's outputs, by kind.

    - "error": tracebacks, widget failures, error dialogs (``page_errors``);
    - "warning": any stderr output (JupyterLab draws it in a red box), e.g. a RuntimeWarning;
    - "undrawn figure": a matplotlib figure printed as text (``<Figure size 640x480 with 1
      Axes>``) instead of drawn: the figure was made but never shown.
    """
    found = page.evaluate(
        """() => {
            const panel = '.jp-NotebookPanel:not(.lm-mod-hidden) ';
            const out = {warning: [], 'undrawn figure': []};
            const stderr = '[data-mime-type="application/vnd.jupyter.stderr"]';
            for (const el of document.querySelectorAll(panel + '.jp-OutputArea-output' + stderr))
                out.warning.push(el.textContent.slice(0, 400));
            const text = '[data-mime-type="text/plain"]';
            for (const el of document.querySelectorAll(panel + '.jp-OutputArea-output' + text)) {
                const m = el.textContent.match(/<Figure size [^>]*>/);
                if (m) out['undrawn figure'].push(m[0]);
            }
            return out;
        }""")
    found["error"] = page_errors(page)
    return found


def drawn_images(page) -> int:
    """How many images (figures, PNGs) the open notebook's outputs show, each fully loaded."""
    return page.evaluate(
        """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) '
                  + '.jp-OutputArea-output img')]
                 .filter(i => i.complete && i.naturalWidth > 0).length""")
