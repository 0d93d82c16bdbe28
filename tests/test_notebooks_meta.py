"""Notebook hygiene and the JupyterLab server of `./course lab`."""
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from course_lib import nbtools

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert (ROOT / "notebooks" / "00_setup.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nbtools.is_clean(nb), f"{path.name} has outputs: run ./course strip"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} stores widget state"
    ids = [c.get("id") for c in nb["cells"]]  # nbformat 4.5: every cell has a unique id
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: missing or repeated ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_the_template(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith("# ")
    first_code = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "course_lib" in first_code and "describe()" in first_code, (
        "the first code cell imports course_lib and prints the device")
    for cell in cells:
        src = "".join(cell["source"])
        assert "sys.path" not in src, "no sys.path hacks: course_lib is installed"
        assert "data:image" not in src, "figures live in images/, not base64 in cells"


def test_strip_round_trip(tmp_path):
    text = "# %% [markdown]\n# # Title\n# text\n\n# %%\nx = 1\nprint(x)\n"
    nb = nbtools.from_percent(text)
    assert [c["cell_type"] for c in nb["cells"]] == ["markdown", "code"]
    assert nbtools.is_clean(nb)
    nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    nb["cells"][1]["execution_count"] = 1
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    assert nbtools.main(["check", str(path)]) == 1
    assert nbtools.main(["strip", str(path)]) == 0
    assert nbtools.main(["check", str(path)]) == 0
    assert nbtools.from_percent(nbtools.to_percent(nb))["cells"][1]["source"] == ["x = 1\n",
                                                                                  "print(x)"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_course_lab_serves_the_notebooks():
    port, token = _free_port(), secrets.token_hex(8)
    env = {**os.environ, "COURSE_PYTHON": sys.executable}
    proc = subprocess.Popen(
        [str(ROOT / "course"), "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        listing, deadline = None, time.time() + 90
        while time.time() < deadline and listing is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/notebooks?token={token}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    listing = json.load(r)
            except OSError:
                time.sleep(1)
        assert listing is not None, "JupyterLab did not answer within 90 s"
        names = {item["name"] for item in listing["content"]}
        assert "00_setup.ipynb" in names
        # rooted at the repository: the notebooks' ../images/ links resolve
        image = f"http://127.0.0.1:{port}/files/images/00_launch_1d.png?token={token}"
        with urllib.request.urlopen(image, timeout=10) as r:
            assert r.status == 200 and r.read(8) == b"\x89PNG\r\n\x1a\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
