"""slides/: one Marp deck per lesson group, English and Chinese, rendered by marp-cli.

Every deck of course_lib.lessons exists in slides/ and slides/zh/, renders to HTML with the
pinned marp-cli (``npm ci``), links only images that exist, has speaker notes on every slide, a
title slide and a closing slide that names the deck's notebooks, and quotes the numbers that
course_lib computes today (``course_lib.results.facts``). With a Chromium present, every slide is
laid out at 1280×720 and checked for overflow, and two decks are exported to PDF.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from course_lib import slides

ROOT = Path(__file__).resolve().parent.parent
DECKS = slides.deck_names()
LANGS = tuple(slides.LANGS)
MD_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")

needs_marp = pytest.mark.skipif(
    slides.marp_executable() is None or shutil.which("node") is None,
    reason="marp-cli is not installed: run `npm ci` in the repository root (needs node and npm)")
needs_chromium = pytest.mark.skipif(
    slides.chrome_path() is None or slides.marp_executable() is None,
    reason="no Chromium (apt-get install chromium fonts-noto-cjk) or no marp-cli (npm ci)")


def slides_of_markdown(path: Path) -> tuple[str, list[str]]:
    """(front matter, slide bodies) of a deck, split on Marp's '---' separators."""
    text = path.read_text()
    _, front, body = text.split("---\n", 2)
    return front, re.split(r"\n---\n", body)


def test_deck_names_match_the_lesson_map():
    assert DECKS == ["01_softmax", "02_gpu_tiling", "03_attention_io", "04_flash_v1",
                     "05_triton_flash", "06_backward", "07_decoding", "08_variants",
                     "09_serving"]
    for lang in LANGS:
        on_disk = sorted(p.stem for p in slides.LANGS[lang].glob("*.md"))
        assert on_disk == DECKS, f"{lang}: {on_disk}"


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("deck", DECKS)
def test_deck_source(deck, lang):
    path = slides.deck_path(deck, lang)
    front, bodies = slides_of_markdown(path)
    for directive in ("marp: true", "math: katex", "size: 16:9", "paginate: true"):
        assert directive in front, f"{path.name}: front matter lacks {directive!r}"
    assert ("lang: zh-CN" if lang == "zh" else "lang: en") in front
    assert 10 <= len(bodies) <= 20, f"{path}: {len(bodies)} slides"
    assert "_class: title" in bodies[0] and re.search(r"^# ", bodies[0], re.M), "no title slide"
    assert "_class: closing" in bodies[-1], "the last slide is not the closing slide"
    for nb in slides.notebooks_of(deck):
        assert f"`{nb}`" in bodies[-1] or f"notebooks/{nb}.ipynb" in bodies[-1], \
            f"closing slide does not name {nb}"
    # Images: relative links into images/, each of which exists.
    depth = "../../" if lang == "zh" else "../"
    for link in MD_IMAGE.findall(path.read_text()):
        assert link.startswith(f"{depth}images/"), f"{path.name}: {link}"
        assert (path.parent / link).resolve().exists(), f"{path.name}: {link} does not exist"
    # Derivations in KaTeX: display math on several slides.
    assert path.read_text().count("$$") >= 4, f"{path.name}: no derivations in $$...$$"


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("deck", DECKS)
def test_code_on_a_slide_is_a_faithful_cut_of_the_source(deck, lang):
    """Every ```python block of a deck is lines of one course_lib module, in order, with "..."
    where lines are left out: a loop on a slide is the loop that runs (comments may differ)."""
    problems = slides.excerpt_problems(decks={deck}, langs={lang})
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("deck", DECKS)
def test_speaker_notes_say_what_the_data_says(deck, lang):
    """A measured number in the notes is a fact or stands on a slide; only the last deck says
    it is the last."""
    problems = slides.notes_problems(decks={deck}, langs={lang})
    assert not problems, "\n".join(problems)


def test_a_cut_that_drops_a_line_silently_is_caught():
    source = {"k.py": ["for start_n in range(lo, hi, BLOCK_N):", "k_ptrs = K + start_n",
                       "k = tl.load(k_ptrs)", "qk = tl.dot(q, k)"]}
    whole = "for start_n in range(lo, hi, BLOCK_N):\n    k_ptrs = K + start_n  # advance\n" \
            "    k = tl.load(k_ptrs)\n    qk = tl.dot(q, k)\n"
    assert slides.unfaithful(whole, source) is None
    marked = "for start_n in range(lo, hi, BLOCK_N):\n    ...\n    qk = tl.dot(q, k)\n"
    assert slides.unfaithful(marked, source) is None
    dropped = "for start_n in range(lo, hi, BLOCK_N):\n    k = tl.load(k_ptrs)\n"
    assert "mark them with '...'" in slides.unfaithful(dropped, source)
    made_up = "for start_n in range(lo, hi, BLOCK_N):\n    k = tl.load(K)\n"
    assert "is not in k.py" in slides.unfaithful(made_up, source)


def test_decks_quote_the_numbers_the_code_computes():
    from course_lib import results

    problems = [p for p in results.check() if p.startswith("slides/")]
    assert not problems, "\n".join(problems)


# --- the closing slide's exercises: the catalogue's, in both languages ------------------------

@pytest.fixture(scope="module")
def catalogue():
    from course_lib.exercises import catalogue

    return catalogue()


def test_every_exercise_has_a_slide_phrase(catalogue):
    """Every exercise of the catalogue has a short phrase in English and in Chinese
    (course_lib/data/exercise_phrases.json), and the table names no other."""
    phrases = slides.exercise_phrases()
    exercises = {n for n, e in catalogue.items() if e.kind != "question"}
    assert set(phrases) == exercises, (f"no phrase: {sorted(exercises - set(phrases))}; "
                                       f"no exercise: {sorted(set(phrases) - exercises)}")
    for name, phrase in phrases.items():
        assert set(phrase) == set(LANGS), name
        assert all(phrase[lang].strip() for lang in LANGS), name
        assert len(phrase["en"]) <= 40 and len(phrase["zh"]) <= 20, f"{name}: not a slide phrase"
        outside = re.sub(r"\([^)]*\)", "", phrase["en"] + phrase["zh"])  # "(m, d)" is a name
        for sep in (", ", "; ", "、", "；"):  # the separators of a line
            assert sep not in outside, f"{name}: {sep!r} in a phrase"


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("deck", DECKS)
def test_closing_slide_lists_the_catalogue_exercises(deck, lang, catalogue):
    """The closing slide's exercise list is the block ``exercise_block`` generates from the
    catalogue, between its markers, once (python -m course_lib.slides exercises --write)."""
    problems = slides.exercise_problems(decks={deck}, langs={lang}, items=catalogue)
    assert not problems, "\n".join(problems)
    front, bodies = slides_of_markdown(slides.deck_path(deck, lang))
    assert slides.exercise_block(deck, lang, catalogue) in bodies[-1]


def _fake_catalogue(*names):
    """A catalogue of stand-ins for 10_backward (deck 06): a name ending in "_k" is a Triton
    exercise, one starting with "q" a think-question, the others Python exercises."""
    from types import SimpleNamespace

    def kind(n):
        return "question" if n.startswith("q") else "triton" if n.endswith("_k") else "python"
    return {n: SimpleNamespace(lesson="10_backward", kind=kind(n)) for n in names}


FAKE_PHRASES = {"five": {"en": "the five formulas", "zh": "五个公式"},
                "delta_k": {"en": "the delta kernel", "zh": "delta 核函数"},
                "new": {"en": "a new one", "zh": "新的练习"}}


@pytest.fixture
def fake_decks(tmp_path, monkeypatch):
    """slides/06_backward.md and slides/zh/06_backward.md in ``tmp_path``, each with the block
    of a fake catalogue (five, delta_k, q1) on its closing slide."""
    folders = {"en": tmp_path / "slides", "zh": tmp_path / "slides" / "zh"}
    items = _fake_catalogue("five", "delta_k", "q1")
    phrases = {n: FAKE_PHRASES[n] for n in ("five", "delta_k")}
    for lang, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        block = slides.exercise_block("06_backward", lang, items, phrases)
        (folder / "06_backward.md").write_text(f"# Summary\n\n{block}\n\n<!-- notes -->\n")
    monkeypatch.setattr(slides, "LANGS", folders)
    return folders, items, phrases


def test_the_generated_list(fake_decks):
    _, items, phrases = fake_decks
    assert slides.exercise_lines("06_backward", "en", items, phrases) == [
        "**Notebooks and their exercises:**",
        "- `10_backward`: the five formulas; Triton: the delta kernel"]
    assert slides.exercise_lines("06_backward", "zh", items, phrases) == [
        "**笔记本及其练习：**", "- `10_backward`：五个公式；Triton：delta 核函数"]
    assert slides.exercise_problems(items=items, phrases=phrases) == []


def test_an_exercise_added_to_the_catalogue_fails_the_check(fake_decks):
    folders, items, phrases = fake_decks
    more = {**items, **_fake_catalogue("new")}
    problems = slides.exercise_problems(items=more, phrases=phrases)
    assert problems == ["exercise 'new' has no slide phrase in en, zh: add it to "
                        "course_lib/data/exercise_phrases.json"], problems
    phrases = {**phrases, "new": FAKE_PHRASES["new"]}
    problems = slides.exercise_problems(items=more, phrases=phrases)
    assert len(problems) == 2 and all("differ from the catalogue: run python -m "
                                      "course_lib.slides exercises --write" in p
                                      for p in problems), problems
    assert len(slides.write_exercises(items=more, phrases=phrases)) == 2
    assert slides.exercise_problems(items=more, phrases=phrases) == []
    assert "the five formulas, a new one; Triton" in (folders["en"] / "06_backward.md").read_text()


def test_an_exercise_removed_from_the_catalogue_fails_the_check(fake_decks):
    _, items, phrases = fake_decks
    fewer = {n: e for n, e in items.items() if n != "five"}
    problems = slides.exercise_problems(items=fewer, phrases=phrases)
    assert problems == ["course_lib/data/exercise_phrases.json: 'five' is no exercise of the "
                        "catalogue"], problems
    phrases = {n: p for n, p in phrases.items() if n != "five"}
    problems = slides.exercise_problems(items=fewer, phrases=phrases)
    assert len(problems) == 2 and all("differ from the catalogue" in p for p in problems)


def test_a_deck_needs_exactly_one_block(fake_decks):
    folders, items, phrases = fake_decks
    deck = folders["zh"] / "06_backward.md"
    text = deck.read_text()
    deck.write_text(text + "\n" + text)
    deck_en = folders["en"] / "06_backward.md"
    deck_en.write_text(deck_en.read_text().replace(slides.EXERCISES_END, ""))
    problems = slides.exercise_problems(items=items, phrases=phrases)
    assert [p.split(":")[0] for p in problems] == ["en/06_backward.md", "zh/06_backward.md"]
    assert "0 marked exercise blocks" in problems[0] and "2 marked" in problems[1], problems
    with pytest.raises(ValueError, match="0 marked exercise blocks"):
        slides.write_exercises(items=items, phrases=phrases)


def test_the_exercises_command(fake_decks, monkeypatch, capsys):
    _, items, phrases = fake_decks
    monkeypatch.setattr(slides, "_catalogue", lambda: {**items, **_fake_catalogue("new")})
    monkeypatch.setattr(slides, "exercise_phrases",
                        lambda: {**phrases, "new": FAKE_PHRASES["new"]})
    assert slides.main(["exercises"]) == 1
    assert "exercises --write" in capsys.readouterr().out
    assert slides.main(["exercises", "--write"]) == 0
    assert slides.main(["exercises"]) == 0


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    return out, slides.render_html(out)


@pytest.mark.slides
@needs_marp
def test_every_deck_renders_to_html(rendered):
    out, html = rendered
    expected = {f"{d}.html" for d in DECKS}
    assert {p.name for p in html if p.parent == out / "html"} == expected
    assert {p.name for p in html if p.parent == out / "html" / "zh"} == expected
    for page in html:
        text = page.read_text()
        assert 'class="katex' in text, f"{page.name}: no KaTeX output"
        assert "katex-fonts/KaTeX_Main-Regular" in text, "KaTeX fonts not served locally"
        assert (page.parent / "katex-fonts" / "KaTeX_Main-Regular.woff2").exists()


@pytest.mark.slides
@needs_marp
def test_rendered_image_links_resolve(rendered):
    _, html = rendered
    for page in html:
        info = slides.slides_of(page)
        assert info["images"], f"{page.name} shows no figure"
        assert slides.broken_images(page) == [], page.name


@pytest.mark.slides
@needs_marp
def test_every_slide_has_speaker_notes(rendered):
    _, html = rendered
    for page in html:
        info = slides.slides_of(page)
        assert info["slides"] >= 10
        silent = [i + 1 for i in range(info["slides"]) if not info["notes"].get(i)]
        assert not silent, f"{page.relative_to(page.parents[1])}: no notes on slides {silent}"


@pytest.mark.slides
@needs_chromium
def test_no_slide_overflows(rendered):
    _, html = rendered
    problems = slides.check_layout(html)
    report = [f"{Path(f).name} slide {p['slide']}: {p['element']} {p['what']!r} "
              f"(top {p['top']}, bottom {p['bottom']}, right {p['right']})"
              for f, items in problems.items() for p in items]
    assert not report, "\n".join(report)


@pytest.mark.slides
@needs_chromium
def test_smallest_text_is_readable_from_the_back(rendered):
    """Every slide's smallest text, HTML and inside its figures (their smallest font at the size
    the slide draws them), is at least MIN_TEXT_PX pixels of a 1280×720 slide."""
    _, html = rendered
    problems = slides.check_readability(html)
    assert not problems, "\n".join(problems)


@pytest.mark.slides
@needs_chromium
def test_pdf_export(tmp_path):
    decks = [slides.deck_path("01_softmax", "en"), slides.deck_path("01_softmax", "zh")]
    pdfs = slides.render_pdf(tmp_path, decks=decks)
    n_slides = len(slides_of_markdown(decks[0])[1])
    for pdf in pdfs:
        data = pdf.read_bytes()
        assert data.startswith(b"%PDF"), pdf
        if shutil.which("pdfinfo"):
            info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True).stdout
            assert re.search(rf"^Pages:\s+{n_slides}$", info, re.M), info
    # Chromium draws Chinese text only with a CJK font installed; without one the zh PDF shows
    # empty boxes, which no PDF check would notice.
    if shutil.which("fc-list"):
        cjk = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True,
                             text=True).stdout.strip()
        assert cjk, "no Chinese font for Chromium: apt-get install fonts-noto-cjk"
    if shutil.which("pdftotext"):
        text = subprocess.run(["pdftotext", str(pdfs[1]), "-"], capture_output=True,
                              text=True).stdout
        assert "学习目标" in text and "在线" in text, "the zh PDF lost its Chinese text"
