"""The instructor slides: render every Marp deck, and the numbers the decks quote.

    python -m course_lib.slides render          # every deck -> slides/build/html/ (HTML)
    python -m course_lib.slides render --pdf    # ... and slides/build/pdf/ (needs Chromium)
    python -m course_lib.slides pages           # PDF pages -> slides/build/png/ (pdftoppm)
    python -m course_lib.slides check           # images, speaker notes, layout, quoted numbers,
                                                # code excerpts cut faithfully from the source,
                                                # closing slides' exercises as the catalogue's
    python -m course_lib.slides exercises [--write]   # the closing slides' exercise lists:
                                                # compare with (or rewrite from) the catalogue

The decks are slides/NN_topic.md (English) and slides/zh/NN_topic.md (Chinese), one per lesson
group of ``course_lib.lessons.LESSONS``; their figures are images/<stem>.png, made by
``python -m course_lib.figures``. Rendering uses marp-cli, pinned in package.json (``npm ci``
installs it into node_modules/); PDF export also needs a Chromium (Debian: ``apt-get install
chromium fonts-noto-cjk``; ``CHROME_PATH`` points marp-cli at it). KaTeX's fonts are served from
node_modules/katex, so the output needs no network.

slides/build/ (ignored by git) is self-contained: html/*.html and html/zh/*.html with their KaTeX
fonts, images/ (a copy of images/, where the decks' relative links land), pdf/ and png/.

The numbers a deck quotes come from ``course_lib.results.facts()``, the one source of the
README's, the decks' and the lessons' numbers; ``check`` fails when a deck no longer prints one.
The exercise list of each closing slide is generated from the exercise catalogue
(``course_lib.exercises``, one line per notebook) with a phrase per exercise from
course_lib/data/exercise_phrases.json; ``check`` fails when a deck's list is not the catalogue's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course_lib import results
from course_lib.results import LANGS, ROOT, SLIDES, deck_path  # noqa: F401 (the decks, re-exported)

BUILD = SLIDES / "build"
IMAGES = ROOT / "images"
KATEX_FONTS = ROOT / "node_modules" / "katex" / "dist" / "fonts"


def deck_names() -> list[str]:
    """The deck stems of the lesson map, in teaching order."""
    from course_lib.lessons import LESSONS

    names = []
    for lesson in LESSONS:
        if lesson.deck and lesson.deck not in names:
            names.append(lesson.deck)
    return names


def notebooks_of(name: str) -> list[str]:
    """The notebooks a deck presents (course_lib.lessons)."""
    from course_lib.lessons import LESSONS

    return [lesson.notebook for lesson in LESSONS if lesson.deck == name]


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

def marp_executable() -> Path | None:
    """node_modules/.bin/marp (installed by ``npm ci`` from package-lock.json), or None."""
    path = ROOT / "node_modules" / ".bin" / "marp"
    return path if path.exists() else None


def chrome_path() -> str | None:
    """A Chromium/Chrome for PDF export: $CHROME_PATH, else the first one on PATH."""
    env = os.environ.get("CHROME_PATH")
    if env and Path(env).exists():
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run_marp(args: list[str], config: dict, env: dict | None = None) -> None:
    marp = marp_executable()
    if marp is None:
        raise RuntimeError("marp-cli is not installed: run `npm ci` in the repository root")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "marp.config.json"
        cfg.write_text(json.dumps(config))
        cmd = [str(marp), "--no-stdin", "--config-file", str(cfg), *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    if proc.returncode != 0 or "[ ERROR ]" in proc.stderr:
        raise RuntimeError(f"marp failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")


def _katex(font_path: str) -> dict:
    return {"options": {"math": {"lib": "katex", "katexFontPath": font_path}}}


def render_html(out: Path = BUILD) -> list[Path]:
    """Every deck (slides/**.md) to ``out``/html/, with images/ and KaTeX fonts beside it."""
    out = Path(out)
    html = out / "html"
    _run_marp(["--html", "--input-dir", str(SLIDES), "--output", str(html)], _katex("katex-fonts/"))
    # The decks link ../images/ (English) and ../../images/ (Chinese): from html/ and html/zh/
    # both land on out/images/. KaTeX fonts sit next to each HTML file ("katex-fonts/").
    if (out / "images").exists():
        shutil.rmtree(out / "images")
    shutil.copytree(IMAGES, out / "images")
    for folder in (html, html / "zh"):
        if KATEX_FONTS.exists() and folder.exists():
            shutil.copytree(KATEX_FONTS, folder / "katex-fonts", dirs_exist_ok=True)
    return sorted(html.rglob("*.html"))


def render_pdf(out: Path = BUILD, decks=None) -> list[Path]:
    """Every deck (or the markdown files ``decks``) to ``out``/pdf/ through Chromium.

    Presenter notes become PDF annotations, headings become PDF outlines.
    """
    chrome = chrome_path()
    if chrome is None:
        raise RuntimeError("no Chromium found: install it (Debian: apt-get install chromium "
                           "fonts-noto-cjk) or set CHROME_PATH")
    pdf = Path(out) / "pdf"
    # Images load from the sources' folders (file://), so PDFs need --allow-local-files.
    args = ["--pdf", "--pdf-notes", "--pdf-outlines", "--allow-local-files",
            "--browser-timeout", "120"]
    config, env = _katex(KATEX_FONTS.as_uri() + "/"), {"CHROME_PATH": chrome}
    if decks is None:
        _run_marp([*args, "--input-dir", str(SLIDES), "--output", str(pdf)], config, env)
        return sorted(pdf.rglob("*.pdf"))
    written = []
    for md in decks:
        target = pdf / Path(md).resolve().relative_to(SLIDES).with_suffix(".pdf")
        target.parent.mkdir(parents=True, exist_ok=True)
        _run_marp([*args, str(md), "--output", str(target)], config, env)
        written.append(target)
    return written


def render_pages(out: Path = BUILD, dpi: int = 50) -> list[Path]:
    """Each PDF page as a PNG (pdftoppm, from poppler-utils) in ``out``/png/, for review."""
    if shutil.which("pdftoppm") is None:
        raise RuntimeError("pdftoppm not found: apt-get install poppler-utils")
    pages = []
    for pdf in sorted((Path(out) / "pdf").rglob("*.pdf")):
        rel = pdf.relative_to(Path(out) / "pdf").with_suffix("")
        target = Path(out) / "png" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["pdftoppm", "-png", "-r", str(dpi), str(pdf), str(target)], check=True)
        pages += sorted(target.parent.glob(f"{target.name}-*.png"))
    return pages


# --------------------------------------------------------------------------------------------
# Checks on the rendered HTML: image links, speaker notes, layout
# --------------------------------------------------------------------------------------------

_NOTE = re.compile(r'<div class="bespoke-marp-note" data-index="(\d+)"[^>]*>(.*?)</div>', re.S)
_SECTION = re.compile(r'<section id="(\d+)"')
_IMG = re.compile(r'<img[^>]+src="([^"]+)"')
_BG = re.compile(r'url\((?:&quot;|"|\')?([^)"\'&]+)(?:&quot;|"|\')?\)')


def slides_of(html: Path) -> dict:
    """What marp rendered: the number of slides, the notes of each, the image links."""
    text = Path(html).read_text()
    notes = {int(i): re.sub(r"<[^>]+>", "", body).strip() for i, body in _NOTE.findall(text)}
    links = [u for u in _IMG.findall(text) + _BG.findall(text)
             if not u.startswith(("data:", "http:", "https:", "#")) and "katex-fonts" not in u]
    return {"slides": len(_SECTION.findall(text)), "notes": notes, "images": links}


def broken_images(html: Path) -> list[str]:
    """Image links of a rendered deck that do not resolve to a file."""
    html = Path(html)
    return [u for u in slides_of(html)["images"] if not (html.parent / u).resolve().exists()]


_LAYOUT_JS = r"""
const puppeteer = require('puppeteer-core');
(async () => {
  const files = JSON.parse(process.env.LAYOUT_FILES);
  const browser = await puppeteer.launch({executablePath: process.env.CHROME_PATH,
    headless: true, args: ['--no-sandbox', '--disable-gpu', '--allow-file-access-from-files']});
  const page = await browser.newPage();
  await page.setViewport({width: 1280, height: 720});
  const out = {};
  for (const f of files) {
    await page.goto('file://' + f, {waitUntil: 'load'});
    await page.evaluate(() => document.fonts.ready);
    out[f] = await page.evaluate(() => {
      const problems = [], sizes = [];
      document.querySelectorAll('section[id]').forEach((sec, idx) => {
        const cs = getComputedStyle(sec);
        const r = sec.getBoundingClientRect();
        const scale = r.height / sec.offsetHeight;
        const bottomMax = sec.offsetHeight - parseFloat(cs.paddingBottom) + 2;
        const rightMax = sec.offsetWidth - parseFloat(cs.paddingRight) + 2;
        const topMin = parseFloat(cs.paddingTop) - 2;
        const own = [...sec.children].filter(e => !['HEADER', 'FOOTER', 'STYLE', 'SCRIPT']
          .includes(e.tagName));
        const inner = [...sec.querySelectorAll('img, table, pre, .katex-display, li, p')];
        for (const e of new Set([...own, ...inner])) {
          const er = e.getBoundingClientRect();
          if (er.width === 0 && er.height === 0) continue;
          const top = (er.top - r.top) / scale, bottom = (er.bottom - r.top) / scale;
          const right = (er.right - r.left) / scale;
          if (bottom > bottomMax || right > rightMax || top < topMin) {
            problems.push({slide: idx + 1, element: e.tagName,
              what: (e.getAttribute('src') || e.textContent || '').trim().slice(0, 50),
              top: Math.round(top), bottom: Math.round(bottom), right: Math.round(right)});
          }
        }
        // Readability: the smallest font of any element that holds text of its own, in slide
        // pixels (1280 x 720), and every image with the width it is drawn at.
        let minPx = 1e9, minWhat = '';
        for (const e of sec.querySelectorAll('*')) {
          if (['STYLE', 'SCRIPT'].includes(e.tagName) || e.closest('header, footer')) continue;
          if (e.closest('.katex-mathml')) continue;  // KaTeX's hidden MathML copy
          const own = [...e.childNodes].filter(n => n.nodeType === 3
                                               && n.textContent.replace(/[\u200b\s]/g, ''));
          if (!own.length) continue;
          const er = e.getBoundingClientRect();
          if (er.width === 0 && er.height === 0) continue;
          const px = parseFloat(getComputedStyle(e).fontSize);
          if (px < minPx) { minPx = px; minWhat = own[0].textContent.trim().slice(0, 40); }
        }
        const images = [...sec.querySelectorAll('img')].map(i => ({
          src: i.getAttribute('src'), width: i.getBoundingClientRect().width / scale,
          natural: i.naturalWidth}));
        sizes.push({slide: idx + 1, text_px: minPx, text_what: minWhat, images});
      });
      return {problems, sizes};
    });
  }
  await browser.close();
  console.log(JSON.stringify(out));
})().catch(e => { console.error(e); process.exit(1); });
"""


#: The smallest text a room can read, in pixels of a 1280×720 slide (figures included).
MIN_TEXT_PX = 18


def _layout(html_files) -> dict:
    """Lay every slide out in Chromium (1280×720): per file, overflow problems and sizes."""
    chrome = chrome_path()
    if chrome is None or shutil.which("node") is None:
        raise RuntimeError("the layout check needs node and a Chromium")
    files = [str(Path(f).resolve()) for f in html_files]
    proc = subprocess.run(["node", "-e", _LAYOUT_JS], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300,
                          env={**os.environ, "CHROME_PATH": chrome,
                               "LAYOUT_FILES": json.dumps(files)})
    if proc.returncode != 0:
        raise RuntimeError(f"layout check failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def check_layout(html_files, layout: dict | None = None) -> dict[str, list[dict]]:
    """Elements outside a slide's padding box: {html path: problems}, each problem naming the
    slide (1-based, the title slide included) and the element. Needs node, puppeteer-core
    (package.json) and a Chromium."""
    layout = _layout(html_files) if layout is None else layout
    return {f: r["problems"] for f, r in layout.items() if r["problems"]}


def figure_text_px(src: str, drawn_width: float, natural_width: float, manifest=None):
    """The smallest text of figure ``src`` as placed on a slide, in slide pixels (None for an
    image that images/MANIFEST.json does not describe): its smallest font in points, at the
    figures' dpi, scaled by the width the slide draws it at."""
    from course_lib import figures

    manifest = figures.load_manifest() if manifest is None else manifest
    entry = manifest["figures"].get(Path(src).stem)
    if entry is None or not natural_width or "min_font_pt" not in entry["content"]:
        return None
    pt = entry["content"]["min_font_pt"]
    return pt * manifest["dpi"] / 72 * drawn_width / natural_width


def check_readability(html_files, layout: dict | None = None,
                      min_px: float = MIN_TEXT_PX) -> list[str]:
    """Slides whose smallest text, HTML or inside a figure, is under ``min_px`` slide pixels."""
    from course_lib import figures

    layout = _layout(html_files) if layout is None else layout
    manifest = figures.load_manifest()
    problems = []
    for f, result in layout.items():
        for page in result["sizes"]:
            where = f"{Path(f).relative_to(Path(f).parents[1])} slide {page['slide']}"
            if page["text_px"] < min_px:
                problems.append(f"{where}: text at {page['text_px']:.1f} px "
                                f"({page['text_what']!r})")
            for img in page["images"]:
                px = figure_text_px(img["src"], img["width"], img["natural"], manifest)
                if px is not None and px < min_px:
                    problems.append(f"{where}: {Path(img['src']).name}'s smallest text at "
                                    f"{px:.1f} px")
    return problems


# --------------------------------------------------------------------------------------------
# code on a slide: a faithful cut of the course's source
# --------------------------------------------------------------------------------------------

_GAP = re.compile(r"^\s*(#\s*)?(\.\.\.|…)\s*$")   # a line "..." or "# ...": lines left out


def _code(line: str) -> str:
    """A line's code: its trailing comment dropped (a # outside quotes), spaces collapsed."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            line = line[:i]
            break
    return " ".join(line.split())


def excerpts(text: str) -> list[str]:
    """The ```python blocks of a deck: each is cut from the course's source."""
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S)
            if lang == "python"]


def _source_lines() -> dict[str, list[str]]:
    """{file: the code of its lines that have code} for every module of course_lib; docstrings
    are not code."""
    import ast

    out = {}
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        text = path.read_text()
        docs = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                docs.update(range(body[0].lineno, body[0].end_lineno + 1))
        out[str(path.relative_to(ROOT))] = [
            c for n, c in enumerate(map(_code, text.splitlines()), 1) if c and n not in docs]
    return out


def unfaithful(excerpt: str, sources: dict[str, list[str]] | None = None) -> str | None:
    """None when ``excerpt`` is a faithful cut of one file of course_lib: its lines of code, in
    order, are lines of that file, and where it skips lines of code the excerpt says so with a
    line "..." (or "# ..."). Comments may differ (a slide annotates, a Chinese deck translates),
    and so may indentation. Otherwise, what is wrong, against the file that matches longest."""
    sources = _source_lines() if sources is None else sources
    items = [None if _GAP.match(line) else _code(line) for line in excerpt.splitlines()]
    items = [x for x in items if x != ""]  # blank and comment-only lines say nothing
    codes = [x for x in items if x is not None]
    if not codes:
        return None
    best = (-1, "", "")
    for name, lines in sources.items():
        for start in (i for i, c in enumerate(lines) if c == codes[0]):
            pos, matched, gap, why = start, 0, False, ""
            for x in items:
                if x is None:
                    gap = True
                    continue
                if matched == 0:
                    matched, pos = 1, start + 1
                    gap = False
                    continue
                if pos < len(lines) and lines[pos] == x:
                    pos, matched, gap = pos + 1, matched + 1, False
                    continue
                if gap and x in lines[pos:]:
                    pos, matched, gap = lines.index(x, pos) + 1, matched + 1, False
                    continue
                why = (f"{x!r} is not the next line of {name}" if x in lines[pos:] and not gap
                       else f"{x!r} is not in {name} after the lines above it")
                if x in lines[pos:] and not gap:
                    why += f" (lines are left out before it: mark them with '...'; the file " \
                           f"has {lines[pos]!r} there)" if pos < len(lines) else ""
                break
            if not why:
                return None
            if matched > best[0]:
                best = (matched, name, why)
    if best[0] < 0:
        return f"its first line {codes[0]!r} is in no file of course_lib"
    return best[2]


def _deck_files(decks=None, langs=None):
    """(language, path) of every deck's markdown, or of those named in ``decks``/``langs``."""
    for lang, folder in LANGS.items():
        if langs is None or lang in langs:
            for path in sorted(folder.glob("*.md")):
                if decks is None or path.stem in decks:
                    yield lang, path


def excerpt_problems(decks=None, langs=None) -> list[str]:
    """Every code excerpt of the decks (English and Chinese) that is not a faithful cut."""
    sources, problems = _source_lines(), []
    for lang, path in _deck_files(decks, langs):
        for i, body in enumerate(excerpts(path.read_text())):
            why = unfaithful(body, sources)
            if why:
                problems.append(f"{lang}/{path.name}: code excerpt {i + 1}: {why}")
    return problems


# --------------------------------------------------------------------------------------------
# speaker notes: the numbers they quote, and what they say of the course
# --------------------------------------------------------------------------------------------

_MEASURED = re.compile(r"(?<![\w.])(\d+(?:[.,]\d+)?)\s*(µs|us|ms|TFLOP/s|GB/s|TB/s|GiB|GB|MiB|MB|"
                       r"KiB|×|x\b|%)")
_LAST = re.compile(r"last deck|final deck|最后一讲")


def notes_problems(decks=None, langs=None, f: dict | None = None) -> list[str]:
    """Speaker notes say what the data and the course say. A number with a unit in the notes
    (µs, ms, TFLOP/s, GB, ×, %, ...) is a fact of ``results.facts()`` or stands on one of the
    deck's slides (whose numbers ``results.check`` holds to the facts); only the last deck of
    ``deck_names()`` may call itself the last."""
    f = results.facts() if f is None else f
    texts = [fact.text for fact in f.values()]
    names = deck_names()
    problems = []
    for lang, path in _deck_files(decks, langs):
        text = path.read_text()
        notes = re.findall(r"<!--(.*?)-->", text, re.S)
        shown = re.sub(r"<!--.*?-->", "", text, flags=re.S)
        for note in notes:
            for m in _MEASURED.finditer(note):
                if not any(m.group(1) in t for t in texts) and m.group(1) not in shown:
                    problems.append(f"{lang}/{path.name}: the notes quote {m.group(0)!r}, "
                                    "which is neither a fact of results.facts() nor on a "
                                    "slide of the deck")
            if _LAST.search(note) and path.stem != names[-1]:
                problems.append(f"{lang}/{path.name}: the notes call it the last deck; "
                                f"{names[-1]} follows")
    return problems


# --------------------------------------------------------------------------------------------
# the closing slide's exercises: generated from the exercise catalogue
# --------------------------------------------------------------------------------------------

#: A short slide phrase per exercise of ``course_lib.exercises.catalogue()``, English and
#: Chinese ({name: {"en": ..., "zh": ...}}). Think-questions are not listed: the closing slide
#: lists what the student writes.
PHRASES = ROOT / "course_lib" / "data" / "exercise_phrases.json"
#: The generated block of a closing slide sits between these lines (24 px text, ``.small``).
#: The markers are HTML, not Markdown comments: Marp would show a comment as a speaker note.
EXERCISES_BEGIN = ('<div class="small"><!-- exercises: generated by '
                   'python -m course_lib.slides exercises --write; do not edit -->')
EXERCISES_END = "</div><!-- end of exercises -->"
WRITE_EXERCISES = "python -m course_lib.slides exercises --write"
_EXERCISE_WORDS = {
    "en": {"head": "**Notebooks and their exercises:**", "sep": ", ", "colon": ": ",
           "triton": "Triton: ", "group": "; ", "none": "no exercises"},
    "zh": {"head": "**笔记本及其练习：**", "sep": "、", "colon": "：",
           "triton": "Triton：", "group": "；", "none": "没有练习"},
}


def exercise_phrases() -> dict:
    """{exercise name: {"en": phrase, "zh": phrase}} (course_lib/data/exercise_phrases.json)."""
    return json.loads(PHRASES.read_text())


def _catalogue() -> dict:
    from course_lib.exercises import catalogue

    return catalogue()


def exercise_lines(name: str, lang: str = "en", items: dict | None = None,
                   phrases: dict | None = None) -> list[str]:
    """The closing slide's list of deck ``name``'s notebooks and their exercises: a heading, then
    one line per notebook, its exercises in catalogue order (those in Python, then those in
    Triton; think-questions are not listed). ``items`` (default: the catalogue) maps a name to an
    object with ``lesson`` and ``kind``; ``phrases`` defaults to ``exercise_phrases()``."""
    items = _catalogue() if items is None else items
    phrases = exercise_phrases() if phrases is None else phrases
    words = _EXERCISE_WORDS[lang]
    lines = [words["head"]]
    for nb in notebooks_of(name):
        mine = [(n, e) for n, e in items.items() if e.lesson == nb]
        python = [phrases[n][lang] for n, e in mine if e.kind == "python"]
        triton = [phrases[n][lang] for n, e in mine if e.kind == "triton"]
        groups = [words["sep"].join(python)] if python else []
        groups += [words["triton"] + words["sep"].join(triton)] if triton else []
        lines.append(f"- `{nb}`{words['colon']}{words['group'].join(groups) or words['none']}")
    return lines


def exercise_block(name: str, lang: str = "en", items: dict | None = None,
                   phrases: dict | None = None) -> str:
    """The markers and, between them, ``exercise_lines``: what the closing slide holds."""
    body = "\n".join(exercise_lines(name, lang, items, phrases))
    return f"{EXERCISES_BEGIN}\n\n{body}\n\n{EXERCISES_END}"


def _blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each marked exercise block of a deck's text, markers included."""
    found, pos = [], 0
    while (start := text.find(EXERCISES_BEGIN, pos)) >= 0:
        end = text.find(EXERCISES_END, start)
        if end < 0:
            break
        found.append((start, end + len(EXERCISES_END)))
        pos = end
    return found


def exercise_problems(decks=None, langs=None, items: dict | None = None,
                      phrases: dict | None = None) -> list[str]:
    """What keeps the closing slides' exercise lists from being the catalogue's: an exercise
    without a phrase in both languages, a phrase of no exercise, a deck without exactly one
    marked block, a block that differs from ``exercise_block``."""
    items = _catalogue() if items is None else items
    phrases = exercise_phrases() if phrases is None else phrases
    problems = []
    for n, e in items.items():
        if e.kind != "question":
            missing = [lang for lang in LANGS if not phrases.get(n, {}).get(lang, "").strip()]
            if missing:
                problems.append(f"exercise {n!r} has no slide phrase in {', '.join(missing)}: "
                                f"add it to {PHRASES.relative_to(ROOT)}")
    problems += [f"{PHRASES.relative_to(ROOT)}: {n!r} is no exercise of the catalogue"
                 for n in phrases if n not in items or items[n].kind == "question"]
    if problems:
        return problems
    for lang, path in _deck_files(decks, langs):
        text = path.read_text()
        blocks = _blocks(text)
        where = f"{lang}/{path.name}"
        if len(blocks) != 1 or text.count(EXERCISES_BEGIN) != 1 or text.count(EXERCISES_END) != 1:
            problems.append(f"{where}: {len(blocks)} marked exercise blocks, expected one on "
                            "the closing slide (between the lines EXERCISES_BEGIN and "
                            "EXERCISES_END of course_lib/slides.py)")
            continue
        start, end = blocks[0]
        if text[start:end] != exercise_block(path.stem, lang, items, phrases):
            problems.append(f"{where}: the closing slide's exercises differ from the catalogue: "
                            f"run {WRITE_EXERCISES}")
    return problems


def write_exercises(decks=None, langs=None, items: dict | None = None,
                    phrases: dict | None = None) -> list[Path]:
    """Rewrite the marked exercise block of every deck (or of ``decks``/``langs``) from the
    catalogue; returns the decks that changed. A deck without exactly one block is an error."""
    items = _catalogue() if items is None else items
    phrases = exercise_phrases() if phrases is None else phrases
    changed = []
    for lang, path in _deck_files(decks, langs):
        text = path.read_text()
        blocks = _blocks(text)
        if len(blocks) != 1:
            raise ValueError(f"{lang}/{path.name}: {len(blocks)} marked exercise blocks, "
                             "expected one")
        start, end = blocks[0]
        new = text[:start] + exercise_block(path.stem, lang, items, phrases) + text[end:]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


# --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.slides", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="every deck to HTML (and PDF with --pdf)")
    r.add_argument("--pdf", action="store_true", help="also export PDF (needs Chromium)")
    r.add_argument("--pages", action="store_true", help="also PDF pages as PNG (pdftoppm)")
    r.add_argument("--out", type=Path, default=BUILD)
    p = sub.add_parser("pages", help="PDF pages as PNG for review (after render --pdf)")
    p.add_argument("--out", type=Path, default=BUILD)
    p.add_argument("--dpi", type=int, default=50)
    c = sub.add_parser("check", help="render to HTML, then check images, notes and layout")
    c.add_argument("--out", type=Path, default=BUILD)
    e = sub.add_parser("exercises", help="compare the closing slides' exercise lists with the "
                       "catalogue (with --write: rewrite them)")
    e.add_argument("--write", action="store_true", help="rewrite every deck's marked block")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    if args.cmd == "render":
        html = render_html(args.out)
        print(f"{len(html)} HTML decks in {args.out / 'html'} ({time.perf_counter() - t0:.1f} s)")
        if args.pdf or args.pages:
            t1 = time.perf_counter()
            pdf = render_pdf(args.out)
            print(f"{len(pdf)} PDF decks in {args.out / 'pdf'} ({time.perf_counter() - t1:.1f} s)")
        if args.pages:
            print(f"{len(render_pages(args.out))} pages in {args.out / 'png'}")
        return 0
    if args.cmd == "check":
        html = render_html(args.out)
        problems = []
        for f in html:
            info = slides_of(f)
            problems += [f"{f.name}: broken image {u}" for u in broken_images(f)]
            problems += [f"{f.name}: slide {i + 1} has no speaker notes"
                         for i in range(info["slides"]) if not info["notes"].get(i)]
        for f, items in check_layout(html).items():
            problems += [f"{Path(f).name}: slide {p['slide']}: {p['element']} {p['what']!r} "
                         f"outside the slide (top {p['top']}, bottom {p['bottom']}, "
                         f"right {p['right']})" for p in items]
        problems += results.check()
        problems += excerpt_problems() + notes_problems() + exercise_problems()
        for line in problems:
            print("PROBLEM:", line)
        print(f"{len(html)} decks checked in {time.perf_counter() - t0:.1f} s: "
              f"{len(problems)} problems")
        return 1 if problems else 0
    if args.cmd == "exercises":
        if args.write:
            changed = write_exercises()
            print(f"{len(changed)} decks rewritten" + "".join(f"\n  {p}" for p in changed))
            return 0
        problems = exercise_problems()
        for line in problems:
            print("PROBLEM:", line)
        print(f"closing slides' exercises: {len(problems)} problems")
        return 1 if problems else 0
    if args.cmd == "pages":
        print(f"{len(render_pages(args.out, args.dpi))} pages in {args.out / 'png'}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
