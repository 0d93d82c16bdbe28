"""Lessons and lectures that a reader can follow: sources named, no internal references.

- no notebook, deck (EN and ZH), README, figure label or course_lib string refers to the
  private notes the course grew from ("seed 003", "the seed blog", "seeds/001", 种子...), nor
  to the project's tracker or its working sessions ("issue 21", "session 12"), which a reader
  cannot follow: the stored runs' descriptions and the perf notes included;
- every notebook ends with a reading list (links to the public sources), every deck, in both
  languages, with a references slide;
- a deck shows Triton kernel code;
- every lesson is a lesson (at most 3,000 words of markdown; the record of experiments lives in
  its appendix notebook, NNa_*).
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DECKS = sorted((ROOT / "slides").glob("*.md")) + sorted((ROOT / "slides" / "zh").glob("*.md"))
INTERNAL = re.compile(
    r"\bseeds?(?:['’]s)?\s+(?:0\d\d|blog|deck|notes?|lectures?|posts?|sketch|text|document|"
    r"source|material)\b|\bseeds/|seed_sketch|seed sketch|\(seed \d|种子|the seeds?\b(?! of)",
    re.I)
TRACKER = re.compile(r"\b(?:issue|sessions?|tickets?)\s*#?\d+|\bthe issue's\b", re.I)


def cells(path: Path, kind: str) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def places():
    for nb in NOTEBOOKS:
        yield nb.relative_to(ROOT), "\n".join(cells(nb, "markdown") + cells(nb, "code"))
    for deck in DECKS:
        yield deck.relative_to(ROOT), deck.read_text()
    yield Path("README.md"), (ROOT / "README.md").read_text()
    manifest = json.loads((ROOT / "images" / "MANIFEST.json").read_text())
    for stem, entry in manifest["figures"].items():
        yield Path(f"images/{stem}.png"), "\n".join(entry["content"]["texts"]) + "\n" + stem
    for py in sorted((ROOT / "course_lib").rglob("*.py")):
        yield py.relative_to(ROOT), py.read_text()
    for path in [ROOT / "ARCHITECTURE.md", *sorted((ROOT / "course_lib" / "data").glob("*.md")),
                 *sorted((ROOT / "course_lib" / "data").glob("*.json"))]:
        yield path.relative_to(ROOT), path.read_text()


def test_no_internal_references():
    found = [f"{where}: {m.group(0)!r}" for where, text in places()
             for m in INTERNAL.finditer(text)]
    assert not found, "name the public source instead:\n" + "\n".join(found)


def test_no_tracker_or_session_numbers():
    """The course speaks of itself: a lesson, a shape, a topic, a date; never a tracker's issue or
    a working session a reader cannot open."""
    found = [f"{where}: {m.group(0)!r}" for where, text in places()
             for m in TRACKER.finditer(text)]
    assert not found, "name the lesson, the shape or the topic instead:\n" + "\n".join(found)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_ends_with_a_reading_list(nb):
    md = cells(nb, "markdown")
    tail = "\n".join(md[-2:])
    assert re.search(r"further reading|reading list|references", tail, re.I), \
        f"{nb.name}: no reading list in its last markdown cells"
    assert len(re.findall(r"\]\(https?://", tail)) >= 1, f"{nb.name}: the reading list has no link"


@pytest.mark.parametrize("deck", DECKS, ids=[str(p.relative_to(ROOT / "slides")) for p in DECKS])
def test_every_deck_has_a_references_slide(deck):
    slides = re.split(r"\n---\n", deck.read_text())
    refs = [s for s in slides if re.search(r"^#+ .*(References|参考)", s, re.M)]
    assert refs, f"{deck.name}: no references slide"
    assert len(re.findall(r"https?://", refs[0])) >= 2, f"{deck.name}: references without links"


def test_a_deck_shows_triton_code():
    blocks = [b for deck in DECKS for b in re.findall(r"```python\n(.*?)```", deck.read_text(),
                                                       re.S)]
    assert any("tl." in b and ("tl.dot" in b or "tl.load" in b) for b in blocks), \
        "no deck shows a Triton kernel's code"


def lesson_words(md: list[str]) -> int:
    """The words a student reads in a lesson's markdown: a formula ($...$ or $$...$$) counts as
    one word, the reading list none."""
    words = 0
    for cell in md:
        if re.match(r"#+ Further reading", cell):
            continue
        words += len(re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$", "x", cell, flags=re.S).split())
    return words


LESSONS_PROPER = [p for p in NOTEBOOKS if not re.match(r"\d+a_", p.name)]  # not appendices


@pytest.mark.parametrize("nb", LESSONS_PROPER, ids=[p.stem for p in LESSONS_PROPER])
def test_a_lesson_is_a_lesson_not_a_lab_notebook(nb):
    """Every lesson has at most 3,000 words; the record of measurements lives in the lesson's
    appendix notebook (NNa_*) and in course_lib/data/perf_notes.md."""
    words = lesson_words(cells(nb, "markdown"))
    assert words <= 3000, f"{nb.stem} has {words} words of lesson (at most 3,000)"


def test_every_appendix_follows_its_lesson():
    for appendix in (p for p in NOTEBOOKS if p not in LESSONS_PROPER):
        number = re.match(r"(\d+)a_", appendix.name).group(1)
        assert any(p.name.startswith(number + "_") for p in LESSONS_PROPER), appendix.name
