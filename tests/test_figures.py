"""images/: every figure comes from course_lib code (python -m course_lib.figures), reproducibly.

- ``course_lib.figures.MODULES`` lists every module that defines a module-level ``FIGURES``;
- drawing a figure twice gives the same PNG bytes, without the matplotlib version in them;
- every ``images/<stem>.png`` that a slide deck or a notebook links to exists and is drawn by a
  ``FIGURES`` function (no hand-made or pasted images), and images/ holds nothing else;
- images/ equals a fresh render (byte for byte where the library versions are those recorded
  in images/MANIFEST.json; otherwise the test says why it cannot compare).
"""
import hashlib
import json
import re
from pathlib import Path

import pytest

from course_lib import figures

ROOT = Path(__file__).resolve().parent.parent
IMAGE_LINK = re.compile(r"(?:\.\./)*images/([\w.-]+\.png)")
CHEAP = ("06_block_size_sweep", "08_causal_block_kinds", "06_seed_sketch_error")


def modules_with_figures() -> set[str]:
    found = set()
    for path in (ROOT / "course_lib").rglob("*.py"):
        if re.search(r"^FIGURES\s*(:[^=]*)?=", path.read_text(), re.M):
            rel = path.relative_to(ROOT).with_suffix("")
            found.add(".".join(rel.parts))
    return found


def test_modules_tuple_covers_every_figures_dict():
    listed = set(figures.MODULES)
    assert len(listed) == len(figures.MODULES), "a module is listed twice"
    defined = modules_with_figures()
    assert defined - listed == set(), f"add to course_lib.figures.MODULES: {defined - listed}"
    assert listed - defined == set(), f"listed without a FIGURES dict: {listed - defined}"


def test_stems_are_unique_and_callable():
    stems = figures.collect()
    assert len(stems) >= 20
    for stem, (module, fn) in stems.items():
        assert re.fullmatch(r"[\w-]+", stem), stem
        assert callable(fn), (module, stem)


@pytest.mark.parametrize("stem", CHEAP)
def test_same_bytes_twice_and_no_version_metadata(stem):
    fn = figures.collect()[stem][1]
    first, second = figures.figure_png(fn), figures.figure_png(fn)
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert first == second, f"{stem}: two renders differ"
    assert b"Software" not in first and b"matplotlib" not in first.lower()


def referenced_images() -> dict[str, set[str]]:
    """images/<name>.png links in the slide decks and in the notebooks' markdown cells."""
    refs: dict[str, set[str]] = {}
    for deck in sorted((ROOT / "slides").glob("*.md")) + sorted((ROOT / "slides/zh").glob("*.md")):
        for name in IMAGE_LINK.findall(deck.read_text()):
            refs.setdefault(name, set()).add(str(deck.relative_to(ROOT)))
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                for name in IMAGE_LINK.findall("".join(cell["source"])):
                    refs.setdefault(name, set()).add(str(nb.relative_to(ROOT)))
    return refs


def test_every_referenced_image_exists_and_is_generated():
    refs = referenced_images()
    assert refs, "no deck links to images/"
    stems = figures.collect()
    missing = {n: sorted(w) for n, w in refs.items() if not (figures.IMAGES / n).exists()}
    assert not missing, f"linked but not in images/ (run python -m course_lib.figures): {missing}"
    made_by_hand = {n: sorted(w) for n, w in refs.items() if Path(n).stem not in stems}
    assert not made_by_hand, f"linked images that no FIGURES function draws: {made_by_hand}"


def test_images_folder_holds_only_generated_files():
    manifest = json.loads((figures.IMAGES / figures.MANIFEST).read_text())
    stems = set(figures.collect())
    on_disk = {p.name for p in figures.IMAGES.iterdir()}
    assert on_disk - {figures.MANIFEST} == {f"{s}.png" for s in manifest["figures"]}
    assert set(manifest["figures"]) <= stems, "images/ holds a figure no module draws any more"
    for stem, sha in manifest["figures"].items():
        data = (figures.IMAGES / f"{stem}.png").read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, f"{stem}.png differs from the manifest"


def test_images_equal_a_fresh_render():
    manifest = json.loads((figures.IMAGES / figures.MANIFEST).read_text())
    if manifest["versions"] != figures.versions():
        pytest.skip(f"images/ were made with {manifest['versions']}, this environment has "
                    f"{figures.versions()}: PNG bytes are only comparable between equal versions")
    problems = figures.check()
    assert not problems, "\n".join(problems)
