"""Every figure of the course, regenerated into images/ by one command, and checked on any CPU.

    python -m course_lib.figures              # (re)write images/<stem>.png and the manifest
    python -m course_lib.figures --check      # draw every figure afresh and compare
    python -m course_lib.figures --list       # every stem and the module that draws it
    python -m course_lib.figures STEM ...     # only these (the manifest keeps the others)
    python -m course_lib.figures --check --jobs 1   # in this process only (default: one
                                                    # worker process per CPU)
    python -m course_lib.figures --untranslated   # Chinese twins' texts still to translate

Every figure an English deck shows has a Chinese twin, ``<stem>_zh``: the same figure with its
texts translated by course_lib/data/figures_zh.json (``localized``); the Chinese decks show
the twins. tests/test_figures.py fails on a twin's text left in English.

The notebooks and the slides (slides/*.md, slides/zh/*.md) use these files. Each module listed in
``MODULES`` keeps a dict ``FIGURES = {"stem": fn}``; ``fn()`` returns a matplotlib Figure, or None
where the data it draws (a stored GPU measurement in course_lib/data/) is missing; such a stem is
skipped and reported. The measured figures are drawn from the stored benchmark JSON, never from a
live run, so this command needs no GPU and gives the same pictures everywhere.

What the check compares. Not bytes: the last bits of a computed number depend on which SIMD code
paths a CPU takes (torch's ATen kernels, NumPy's loops, BLAS), and anti-aliased pixels follow.
``images/MANIFEST.json`` keeps, per figure, the SHA-256 of its PNG and its *content*: every text
the figure shows, exactly, and every drawn line, bar, marker and image in axes coordinates
(``figure_content``). ``--check`` draws each figure afresh and

* compares content (any environment): a changed text, a curve moved by more than a tenth of a
  pixel, a changed colour fails; data that is not shown (a value of 1e-16 on a linear axis)
  does not. A figure that *shows* rounding noise (1e-16 against 2e-16 on a log axis, or printed
  in a label) fails on some CPU: show a bound instead (``course_lib.testing.below``);
* compares pixels as an eye would (where matplotlib and FreeType are the versions the images
  were made with; they draw text differently otherwise): a pixel differs when no pixel within
  one of it in the other image is within 10% in every channel;
* checks that every PNG in images/ is the one its manifest names.

Drawing is most of the time, so the figures are drawn in worker processes, one per CPU (spawned:
each starts a fresh interpreter, imports the figure modules as ``collect`` does, and draws a
figure exactly as this process would, into the same PNG bytes); the results are gathered in
the manifest's order, and a figure that raises is reported by its stem, not the whole run.

tests/test_figures.py runs the check under ``ATEN_CPU_CAPABILITY=default``, with NumPy's SIMD
extensions off and with one thread against several (the worker processes inherit all three),
and shows that it fails on a deliberately changed figure. PNGs are saved without the
"Software" text chunk, and matplotlib writes no date into a PNG: two runs on one machine give
byte-identical files.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import pkgutil
import sys
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib import ft2font
from matplotlib.ticker import Formatter

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
MANIFEST = "MANIFEST.json"

#: Every module with a module-level ``FIGURES`` dict (tests/test_figures.py checks the list is
#: complete). Order: roughly the lesson order, which is also the order of images/MANIFEST.json;
#: every module of course_lib/diagrams/ is found by itself and follows.
MODULES = (
    "course_lib.widgets.launch",
    "course_lib.softmax",
    "course_lib.widgets.softmax_steps",
    "course_lib.roofline",
    "course_lib.iomodel.matmul",
    "course_lib.widgets.tiled_matmul",
    "course_lib.iomodel.attention",
    "course_lib.widgets.tile_walk",
    "course_lib.sketch_pitfalls",
    "course_lib.analysis.flash_v2",
    "course_lib.analysis.hopper",
    "course_lib.bench.plots",
    "course_lib.iomodel.backward",
    "course_lib.bench.memory",
    "course_lib.iomodel.decode",
    "course_lib.widgets.split_kv",
    "course_lib.bench.decode",
    "course_lib.kvcache",
    "course_lib.unified_max",
    "course_lib.widgets.block_map",
) + tuple(f"course_lib.diagrams.{m.name}"
          for m in sorted(pkgutil.iter_modules([str(ROOT / "course_lib" / "diagrams")]),
                          key=lambda m: m.name))

DPI = 110
#: rcParams set before every figure (after a reset to matplotlib's defaults, so that no figure
#: inherits another's settings).
RC = {
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],   # bundled with matplotlib: the same glyphs everywhere
    "mathtext.fontset": "dejavusans",
    "svg.hashsalt": "flash-attention-course",
    "savefig.dpi": DPI,
    "figure.dpi": DPI,
}
SAVE = {"format": "png", "dpi": DPI, "bbox_inches": "tight", "pad_inches": 0.08,
        "facecolor": "white", "metadata": {"Software": None}}


def versions() -> dict:
    """The library versions the PNG bytes depend on."""
    import numpy
    return {"matplotlib": matplotlib.__version__,
            "freetype": ft2font.__freetype_version__,
            "numpy": numpy.__version__}


def collect(modules=MODULES, zh: bool = True) -> dict:
    """Stem -> (module name, function), in ``modules`` order; a stem defined twice is an error.
    With ``zh``, every figure an English deck shows also gets its Chinese twin ``<stem>_zh``
    (``localized``), which the Chinese deck shows."""
    found = {}
    for name in modules:
        module = importlib.import_module(name)
        figures = getattr(module, "FIGURES", None)
        if not isinstance(figures, dict):
            raise TypeError(f"{name} has no FIGURES dict")
        for stem, fn in figures.items():
            if stem in found:
                raise ValueError(f"figure stem {stem!r} defined by both {found[stem][0]} "
                                 f"and {name}")
            found[stem] = (name, fn)
    if zh:
        table = zh_texts()
        for stem in deck_stems():
            if stem in found:
                found[f"{stem}{ZH_SUFFIX}"] = (found[stem][0], localized(found[stem][1], table))
    return found


# ------------------------------------------------------------------------------------------
# The Chinese decks' figures: the English figure with its texts translated
# ------------------------------------------------------------------------------------------

ZH_SUFFIX = "_zh"
ZH_TEXTS = ROOT / "course_lib" / "data" / "figures_zh.json"
#: The Chinese twins draw with DejaVu Sans, and with Noto Sans CJK SC (Debian's fonts-noto-cjk,
#: which ``./course test`` installs beside Chromium) for the glyphs DejaVu lacks.
ZH_FONTS = ["DejaVu Sans", "Noto Sans CJK SC"]
_ENGLISH = __import__("re").compile(r"[A-Za-z]{3,}")


def deck_stems() -> list[str]:
    """The figures the English decks (slides/*.md) show, in deck order."""
    import re

    stems = []
    for path in sorted((ROOT / "slides").glob("*.md")):
        for stem in re.findall(r"images/([\w.-]+)\.png", path.read_text()):
            if stem not in stems:
                stems.append(stem)
    return stems


def zh_texts() -> dict:
    """{English text: Chinese text} of the figures' texts (course_lib/data/figures_zh.json): a
    text that stays as it is (a name, a formula) maps to itself."""
    return json.loads(ZH_TEXTS.read_text()) if ZH_TEXTS.exists() else {}


_CJK: list = []


def has_cjk_font() -> bool:
    """Whether matplotlib can draw with ``ZH_FONTS[1]``; fonts installed after matplotlib made
    its font cache are added from the system's font folders first."""
    from matplotlib import font_manager

    if not _CJK:
        found = any(f.name == ZH_FONTS[1] for f in font_manager.fontManager.ttflist)
        if not found:
            for path in font_manager.findSystemFonts():
                if "NotoSansCJK" in Path(path).name:
                    font_manager.fontManager.addfont(path)
            found = any(f.name == ZH_FONTS[1] for f in font_manager.fontManager.ttflist)
        _CJK.append(found)
    return _CJK[0]


class _Translated(Formatter):
    """A tick formatter whose labels go through ``table`` (the Chinese twins' tick labels)."""

    def __init__(self, inner, table: dict):
        self.inner, self.table = inner, table

    def set_axis(self, axis):
        super().set_axis(axis)
        self.inner.set_axis(axis)

    def set_locs(self, locs):
        self.inner.set_locs(locs)

    def __call__(self, x, pos=None):
        s = self.inner(x, pos)
        return self.table.get(s, s)

    def format_ticks(self, values):
        return [self.table.get(s, s) for s in self.inner.format_ticks(values)]

    def get_offset(self):
        return self.inner.get_offset()


def localized(fn, table: dict):
    """``fn`` drawing in Chinese: every text of its figure that ``table`` translates, translated,
    in ``ZH_FONTS``. Returns None (skipped) where no CJK font is installed."""
    def draw_zh():
        if not has_cjk_font():
            return None
        fig = fn()
        if fig is None:
            return None
        from matplotlib.text import Text

        for text in fig.findobj(Text):
            s = text.get_text()
            if s in table:
                text.set_text(table[s])
            text.set_fontfamily(ZH_FONTS)
        # Tick labels are written by the axis's formatters at draw time, over the texts above:
        # translate what the formatters return.
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(_Translated(axis.get_major_formatter(), table))
                axis.set_minor_formatter(_Translated(axis.get_minor_formatter(), table))
        return fig
    draw_zh.__name__ = f"{getattr(fn, '__name__', 'figure')}_zh"
    return draw_zh


def untranslated(texts, table: dict | None = None) -> list[str]:
    """The texts of a Chinese twin still in English: words of three letters or more outside
    $...$ that no entry of ``table`` produced."""
    import re

    table = zh_texts() if table is None else table
    kept = set(table.values())
    return [t for t in texts if t not in kept and _ENGLISH.search(re.sub(r"\$[^$]*\$", "", t))]


# ------------------------------------------------------------------------------------------
# What a figure says: its texts and its drawn geometry, at the precision a reader can see
# ------------------------------------------------------------------------------------------

#: Geometry is compared in axes coordinates (0..1 across an axes), where 1e-4 is a tenth of a
#: pixel on a 1000-pixel axes: below what anyone can see, far above rounding noise in data that
#: is *not* shown (a curve at 1e-16 on a linear axis), and far below a changed curve. Noise
#: that a figure *shows* (a bar at 2.2e-16 against 4.4e-16 on a log axis) moves by whole
#: pixels and fails the check, as it should: such a figure must show a bound instead.
GEOMETRY_TOL = 1e-4
#: Colour-mapped values (an image, a mesh) are compared after the colour norm, in 0..1.
COLOR_TOL = 1e-3
_DIGITS = 6   # stored rounding of axes coordinates, well under GEOMETRY_TOL


def _rounded(a) -> list:
    """A float array as nested lists: axes coordinates rounded to ``_DIGITS`` decimals (values
    of 1000 and more to 9 significant digits); NaN and ±inf as the strings "nan", "inf", "-inf"
    (JSON has no literal for them)."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    if not a.size:
        return []
    out = np.round(a, _DIGITS).astype(object)
    big = np.isfinite(a) & (np.abs(a) >= 1e3)
    out[big] = [float(f"{x:.9g}") for x in a[big]]
    out[np.isnan(a)] = "nan"
    out[np.isposinf(a)] = "inf"
    out[np.isneginf(a)] = "-inf"
    return out.tolist()


def _color(c) -> list:
    from matplotlib.colors import to_rgba

    return [round(float(x), 3) for x in to_rgba(c)]


def _to_axes(transform, ax, xy):
    import numpy as np

    xy = np.asarray(xy, dtype=float).reshape(-1, 2)
    if not len(xy):
        return xy
    return (transform - ax.transAxes).transform(xy)


def _texts(fig) -> list[str]:
    """Every visible, non-empty text of ``fig`` a reader sees, in a fixed order."""
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        titles = [ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)]
        out += [t.get_text() for t in titles if t is not None]
        out += [ax.get_xlabel(), ax.get_ylabel()]
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_visible():
                out += [t.get_text() for t in axis.get_ticklabels(which="both")]
        out += [t.get_text() for t in ax.texts if t.get_visible()]
        legend = ax.get_legend()
        if legend is not None:
            out += [legend.get_title().get_text()] + [t.get_text() for t in legend.get_texts()]
    for legend in fig.legends:
        out += [legend.get_title().get_text()] + [t.get_text() for t in legend.get_texts()]
    return [t for t in out if t and t.strip()]


def _artists(ax) -> list[dict]:
    """The drawn data of one axes: lines, patches, collections, images and placed texts."""
    import numpy as np
    from matplotlib.collections import PathCollection

    found = []
    for line in ax.lines:
        if line.get_visible():
            found.append({"kind": "line", "color": _color(line.get_color()),
                          "xy": _rounded(_to_axes(line.get_transform(), ax, line.get_xydata()))})
    for patch in ax.patches:
        if patch.get_visible():
            found.append({"kind": "patch", "color": _color(patch.get_facecolor()),
                          "xy": _rounded(_to_axes(patch.get_transform(), ax,
                                                  patch.get_path().vertices))})
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        rec = {"kind": type(coll).__name__}
        offsets = np.asarray(coll.get_offsets(), dtype=float)
        if isinstance(coll, PathCollection):  # scatter: positions and marker sizes
            rec["xy"] = _rounded(_to_axes(coll.get_offset_transform(), ax, offsets))
            rec["sizes"] = _rounded(coll.get_sizes())
        else:
            rec["paths"] = [_rounded(_to_axes(coll.get_transform(), ax, p.vertices))
                            for p in coll.get_paths()]
        values = coll.get_array()
        if values is not None:
            rec["values"] = _rounded(coll.norm(np.ma.asarray(values, dtype=float)).filled(np.nan))
        else:
            rec["color"] = [_color(c) for c in coll.get_facecolor()]
        found.append(rec)
    for image in ax.images:
        values = np.ma.asarray(image.get_array(), dtype=float)
        found.append({"kind": "image", "extent": _rounded(image.get_extent()),
                      "values": _rounded(image.norm(values).filled(np.nan))})
    for text in ax.texts:
        if text.get_visible() and text.get_text().strip():
            found.append({"kind": "text", "text": text.get_text(),
                          "xy": _rounded(_to_axes(text.get_transform(), ax,
                                                  [text.get_position()]))})
    return found


def figure_content(fig) -> dict:
    """What a drawn figure says, independent of how its pixels come out.

    Its texts (titles, labels, tick labels, legends, annotations), exactly; and per axes, the
    scales and every drawn artist's geometry in axes coordinates, its colour, and colour-mapped
    values after the norm. Call it after the figure is drawn (``savefig``), when tick labels
    exist. ``compare_content`` compares two of these at the precision a reader can see.
    """
    return {"texts": _texts(fig),
            "min_font_pt": _min_font_pt(fig),
            "axes": [{"scales": [ax.get_xscale(), ax.get_yscale()], "artists": _artists(ax)}
                     for ax in fig.axes]}


def _min_font_pt(fig) -> float:
    """The smallest font size (points) of any visible, non-empty text: with the dpi and the size
    at which a slide places the figure, the smallest text a room must read."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_figure() is not None
             and _shown(t)]
    return round(float(min(sizes)), 2) if sizes else 0.0


def _shown(text) -> bool:
    """False for the tick labels matplotlib keeps but does not draw (outside the view)."""
    axis = getattr(text, "axes", None)
    if axis is None:
        return True
    for a in (axis.xaxis, axis.yaxis):
        for tick in a.get_major_ticks() + a.get_minor_ticks():
            if text in (tick.label1, tick.label2):
                lo, hi = sorted(a.get_view_interval())
                return tick.get_visible() and lo <= tick.get_loc() <= hi and text.get_visible()
    return True


def _numbers(x):
    import numpy as np

    return np.array(x, dtype=object).astype(float) if x != [] else np.zeros(0)


def _differ(a, b, tol) -> str | None:
    """Where two stored arrays differ by more than ``tol`` (NaN/inf must match), or None."""
    import numpy as np

    a, b = _numbers(a), _numbers(b)
    if a.shape != b.shape:
        return f"shape {a.shape} became {b.shape}"
    if not a.size:
        return None
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any() or (a[~fa].astype(str) != b[~fb].astype(str)).any():
        return "a NaN or infinity appeared or moved"
    gap = np.abs(a - b) - tol * (1 + 1e-5 * np.maximum(np.abs(a), np.abs(b)))
    gap[~fa] = -1
    if (gap > 0).any():
        at = np.unravel_index(np.argmax(gap), gap.shape)
        return (f"moved by {np.abs(a - b)[at]:.2g} (tolerance {tol:g}) at index "
                f"{tuple(int(i) for i in at)}: {a[at]:.6g} -> {b[at]:.6g}")
    return None


def compare_content(old: dict, new: dict) -> list[str]:
    """What changed between two ``figure_content`` records, in words (empty: the same)."""
    problems = []
    if old["texts"] != new["texts"]:
        gone = [t for t in old["texts"] if t not in new["texts"]]
        came = [t for t in new["texts"] if t not in old["texts"]]
        problems.append(f"texts changed: {gone[:3]} -> {came[:3]}" if gone or came
                        else "texts changed order")
    if len(old["axes"]) != len(new["axes"]):
        return problems + [f"{len(old['axes'])} axes became {len(new['axes'])}"]
    for i, (a, b) in enumerate(zip(old["axes"], new["axes"])):
        if a["scales"] != b["scales"]:
            problems.append(f"axes {i}: scales {a['scales']} -> {b['scales']}")
        kinds_a = [r["kind"] for r in a["artists"]]
        kinds_b = [r["kind"] for r in b["artists"]]
        if kinds_a != kinds_b:
            problems.append(f"axes {i}: artists {kinds_a} -> {kinds_b}")
            continue
        for j, (ra, rb) in enumerate(zip(a["artists"], b["artists"])):
            where = f"axes {i}, {ra['kind']} {j}"
            for key in sorted(set(ra) | set(rb)):
                va, vb = ra.get(key), rb.get(key)
                if key in ("kind", "text"):
                    if va != vb:
                        problems.append(f"{where}: {key} {va!r} -> {vb!r}")
                elif key == "color":
                    why = _differ(va, vb, 2e-3)
                    if why:
                        problems.append(f"{where}: colour {why}")
                elif key == "paths":
                    if len(va or []) != len(vb or []):
                        problems.append(f"{where}: {len(va or [])} paths -> {len(vb or [])}")
                        continue
                    for k, (pa, pb) in enumerate(zip(va, vb)):
                        why = _differ(pa, pb, GEOMETRY_TOL)
                        if why:
                            problems.append(f"{where}, path {k}: {why}")
                            break
                else:
                    tol = COLOR_TOL if key == "values" else GEOMETRY_TOL
                    why = _differ(va, vb, tol)
                    if why:
                        problems.append(f"{where}: {key} {why}")
    return problems


# ------------------------------------------------------------------------------------------
# Pixels, compared as an eye would: a one-pixel shift of an edge is not a change
# ------------------------------------------------------------------------------------------

#: A pixel differs when no pixel within ``PIXEL_SHIFT`` of it in the other image comes within
#: ``PIXEL_LEVEL`` (on 0..1) in every channel. Anti-aliasing noise moves a pixel by a few
#: levels of 255 and a snapped edge by one pixel; a changed digit, label or curve does more.
PIXEL_LEVEL = 0.1
PIXEL_SHIFT = 1


def _decode(png: bytes):
    import io

    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(io.BytesIO(png), format="png")
    return np.asarray(img[..., :3] if img.shape[-1] == 4 else img, dtype=float)


def _unmatched(a, b, level, shift) -> "np.ndarray":  # noqa: F821
    """Pixels of ``a`` with no pixel of ``b`` within ``shift`` that is within ``level``."""
    import numpy as np

    h, w = a.shape[:2]
    padded = np.pad(b, ((shift, shift), (shift, shift), (0, 0)), mode="edge")
    bad = np.ones((h, w), dtype=bool)
    for dy in range(2 * shift + 1):
        for dx in range(2 * shift + 1):
            near = padded[dy:dy + h, dx:dx + w]
            bad &= np.abs(a - near).max(axis=-1) > level
    return bad


def compare_pixels(old_png: bytes, new_png: bytes, level: float = PIXEL_LEVEL,
                   shift: int = PIXEL_SHIFT) -> str | None:
    """Why two PNGs look different (size, or which pixels), or None when they look the same."""
    import numpy as np

    if old_png == new_png:  # the same bytes: the same pixels, nothing to decode
        return None
    a, b = _decode(old_png), _decode(new_png)
    if a.shape != b.shape:
        return f"size {a.shape[1]}×{a.shape[0]} became {b.shape[1]}×{b.shape[0]} pixels"
    if not (np.abs(a - b).max(axis=-1) > level).any():
        return None
    bad = _unmatched(a, b, level, shift) | _unmatched(b, a, level, shift)
    if not bad.any():
        return None
    ys, xs = np.nonzero(bad)
    return (f"{bad.sum()} pixels differ, in x {xs.min()}–{xs.max()}, y {ys.min()}–{ys.max()} "
            f"(of {a.shape[1]}×{a.shape[0]})")


# ------------------------------------------------------------------------------------------
# Drawing, writing, checking
# ------------------------------------------------------------------------------------------

def draw(fn) -> tuple[bytes, dict] | None:
    """Draw ``fn()``: its PNG bytes and its ``figure_content`` (None where ``fn`` returns None).

    It runs under matplotlib's default rcParams plus ``RC``; the caller's rcParams are restored
    afterwards, so this is safe inside a notebook too.
    """
    import io
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(RC)
        fig = fn()
        if fig is None:
            return None
        buf = io.BytesIO()
        try:
            fig.savefig(buf, **SAVE)
            content = figure_content(fig)
        finally:
            plt.close(fig)
    return buf.getvalue(), content


def figure_png(fn) -> bytes | None:
    """The PNG bytes of ``fn()`` (None where ``fn`` returns None)."""
    drawn = draw(fn)
    return None if drawn is None else drawn[0]


def default_jobs() -> int:
    """How many worker processes draw figures: one per CPU this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _draw_timed(fn) -> tuple:
    """``draw(fn)`` as ("drawn", (png, content)), ("none", None) or ("error", why), and the
    seconds it took: a figure that raises is a result, not the end of the run."""
    import traceback

    t0 = time.perf_counter()
    try:
        result = draw(fn)
    except Exception as exc:  # reported with the figure's stem by the caller
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        why = (f"raised {type(exc).__name__}: {exc} "
               f"({Path(frame.filename).name}:{frame.lineno} in {frame.name})")
        return "error", why, time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    return ("none", None, seconds) if result is None else ("drawn", result, seconds)


#: Below this many figures, ``_draw_all`` draws in this process by default: a worker process
#: spends seconds importing torch and the figure modules before it draws its first figure.
_FEW = 16
_WORKER: dict = {}   # in a worker process: {stem: (module, fn)}, from its own collect()


def _worker_start(zh: bool, threads: int | None) -> None:
    """A worker process's set-up: the parent's backend and torch threads, every figure module
    imported (``collect``, as the parent did)."""
    plt.switch_backend("Agg")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    _WORKER.update(collect(zh=zh))


def _worker_draw(stem: str) -> tuple:
    return _draw_timed(_WORKER[stem][1])


def _draw_in_workers(todo: list[str], jobs: int, zh: bool) -> dict:
    """{stem: ``_draw_timed`` result} for the figures of ``collect(zh)`` named in ``todo``,
    drawn by ``jobs`` spawned worker processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = None
    if "torch" in sys.modules:  # a worker computes with as many threads as this process
        threads = sys.modules["torch"].get_num_threads()
    results = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_start, initargs=(zh, threads)) as pool:
        futures = {pool.submit(_worker_draw, stem): stem for stem in todo}
        for future in as_completed(futures):
            try:
                results[futures[future]] = future.result()
            except Exception as exc:  # the worker itself died or failed to start
                results[futures[future]] = ("error", f"its worker process failed: "
                                            f"{type(exc).__name__}: {exc}", 0.0)
    return results


def _draw_all(stems=None, figures=None, verbose=False, jobs=None, zh=True):
    """{stem: (png, content)}, {stem: why skipped} and {stem: why it failed} for every figure
    (or ``stems``). ``figures`` ({stem: (module, fn)}) draws those functions in this process;
    by default the figures of ``collect(zh)`` are drawn by ``jobs`` worker processes
    (default: ``default_jobs()``, or 1 for fewer than ``_FEW`` figures; 1: in this process)."""
    catalogue = figures is None
    figures = collect(zh=zh) if figures is None else figures
    if stems is not None:
        unknown = set(stems) - set(figures)
        if unknown:
            raise KeyError(f"unknown figure stems: {sorted(unknown)}")
    todo = [stem for stem in figures if stems is None or stem in stems]
    if jobs is None:  # a few figures draw here sooner than a worker process starts
        jobs = default_jobs() if len(todo) >= _FEW else 1
    jobs = min(jobs, len(todo))
    if catalogue and jobs > 1:
        results = _draw_in_workers(todo, jobs, zh)
    else:
        results = {stem: _draw_timed(figures[stem][1]) for stem in todo}
    drawn, skipped, failed = {}, {}, {}
    for stem in todo:  # the order of ``figures``, however the workers finished
        module = figures[stem][0]
        status, result, seconds = results[stem]
        if status == "error":
            failed[stem] = f"{module}: {result}"
            if verbose:
                print(f"  FAILED {stem}: {failed[stem]}")
        elif status == "none":
            skipped[stem] = (f"{module}: no CJK font (apt-get install fonts-noto-cjk)"
                             if stem.endswith(ZH_SUFFIX) and not has_cjk_font() else
                             f"{module}: no data (a stored measurement in course_lib/data "
                             "is missing)")
            if verbose:
                print(f"  skipped {stem}: {skipped[stem]}")
        else:
            drawn[stem] = result
            if verbose:
                print(f"  {stem + '.png':<34} {len(result[0]) / 1024:6.0f} KiB  "
                      f"{seconds:5.2f} s  ({module})")
    return drawn, skipped, failed


def load_manifest(images: Path = IMAGES) -> dict | None:
    path = Path(images) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def _manifest_text(manifest: dict) -> str:
    """The manifest as JSON with one line per figure (readable diffs, a few hundred KiB)."""
    head = {k: v for k, v in manifest.items() if k != "figures"}
    lines = json.dumps(head, indent=1).rstrip("}").rstrip().split("\n")
    lines[-1] += ","
    lines.append(' "figures": {')
    items = list(manifest["figures"].items())
    for i, (stem, entry) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        lines.append(f"  {json.dumps(stem)}: {json.dumps(entry, separators=(',', ':'))}{comma}")
    return "\n".join(lines + [" }", "}"]) + "\n"


def render(out: Path, stems=None, verbose: bool = True, figures=None, jobs=None) -> dict:
    """Write ``out/<stem>.png`` for every figure (or those in ``stems``) and update the manifest.

    ``figures`` ({stem: (module, fn)}, default ``collect()``) lets a test draw its own, in this
    process; ``collect()``'s are drawn by ``jobs`` worker processes (``_draw_all``). Returns
    {"written": {stem: sha256}, "skipped": {stem: reason}, "failed": {stem: what it raised}};
    a figure that failed keeps its old file and manifest entry.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn, skipped, failed = _draw_all(stems, figures, verbose=verbose, jobs=jobs)
    figures = collect() if figures is None else figures
    old = load_manifest(out) or {}
    entries = {} if stems is None else dict(old.get("figures", {}))
    for stem, (png, content) in drawn.items():
        (out / f"{stem}.png").write_bytes(png)
        entries[stem] = {"sha256": hashlib.sha256(png).hexdigest(), "content": content}
    rank = {stem: i for i, stem in enumerate(figures)}  # lesson order; unknown stems last
    ordered = sorted(entries, key=lambda stem: (rank.get(stem, len(rank)), stem))
    manifest = {"generated_by": "python -m course_lib.figures", "versions": versions(),
                "dpi": DPI, "figures": {stem: entries[stem] for stem in ordered}}
    (out / MANIFEST).write_text(_manifest_text(manifest))
    return {"written": {s: e["sha256"] for s, e in entries.items() if s in drawn},
            "skipped": skipped, "failed": failed}


def check(images: Path = IMAGES, stems=None, figures=None, jobs=None,
          zh: bool = True) -> list[str]:
    """Draw every figure (or ``stems`` of ``figures``) afresh and compare it with ``images``.

    ``figures`` ({stem: (module, fn)}) are drawn in this process; by default those of
    ``collect(zh)`` (``zh=False``: the English figures only), by ``jobs`` worker processes.
    Returns the problems found, one line each; empty when images/ is what the code draws now.
    """
    images = Path(images)
    manifest = load_manifest(images)
    if manifest is None:
        return [f"{images / MANIFEST} is missing: run python -m course_lib.figures"]
    drawn, skipped, failed = _draw_all(stems, figures, jobs=jobs, zh=zh)
    stored = manifest["figures"]
    problems = [f"{s}.png could not be drawn: {why}" for s, why in failed.items()]
    if stems is None and figures is None and zh:
        problems += [f"{s}.png is in images/ but no FIGURES function draws it now"
                     for s in sorted(set(stored) - set(drawn) - set(skipped))]
    problems += [f"{s}.png is new: run python -m course_lib.figures"
                 for s in sorted(set(drawn) - set(stored))]
    same_versions = manifest.get("versions") == versions()
    for stem in [s for s in drawn if s in stored]:
        path = images / f"{stem}.png"
        if not path.exists():
            problems.append(f"{path} is missing")
            continue
        committed = path.read_bytes()
        if hashlib.sha256(committed).hexdigest() != stored[stem]["sha256"]:
            problems.append(f"{stem}.png is not the file images/{MANIFEST} names")
            continue
        png, content = drawn[stem]
        problems += [f"{stem}.png: {p}" for p in compare_content(stored[stem]["content"], content)]
        if same_versions:
            why = compare_pixels(committed, png)
            if why:
                problems.append(f"{stem}.png looks different: {why}")
    if not same_versions:
        print(f"note: images/ were made with {manifest.get('versions')}, this environment has "
              f"{versions()}: content compared, pixels only between equal versions")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.figures",
                                     description="Regenerate every course figure into images/.")
    parser.add_argument("--out", type=Path, default=IMAGES, help="output folder (images/)")
    parser.add_argument("--check", action="store_true",
                        help="draw afresh and compare content and pixels with --out")
    parser.add_argument("--list", action="store_true", help="list the stems and their modules")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(N) first (the tests vary it)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="worker processes that draw (default: one per CPU; 1: none, all "
                             "in this process)")
    parser.add_argument("--english", action="store_true",
                        help="with --check: the English figures only (the Chinese twins show "
                             "the same numbers)")
    parser.add_argument("--untranslated", action="store_true",
                        help="the texts of the Chinese twins that course_lib/data/"
                             "figures_zh.json does not translate yet, as JSON to fill in")
    parser.add_argument("stems", nargs="*", help="only these stems")
    args = parser.parse_args(argv)
    plt.switch_backend("Agg")  # headless, and the renderer the images were made with
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.list:
        for stem, (module, _) in collect().items():
            print(f"{stem:<30} {module}")
        return 0
    if args.untranslated:
        table, missing = zh_texts(), {}
        for stem, (_, fn) in collect().items():
            if stem.endswith(ZH_SUFFIX) and (not args.stems or stem in args.stems):
                drawn = draw(fn)
                for text in untranslated(drawn[1]["texts"] if drawn else [], table):
                    missing.setdefault(text, "")
        print(json.dumps(missing, ensure_ascii=False, indent=1))
        return 0
    if args.check:
        problems = check(args.out, stems=args.stems or None, jobs=args.jobs,
                         zh=not args.english)
        for p in problems:
            print("DIFFERENT:", p)
        print(f"{'OK' if not problems else 'FAILED'}: {args.out} checked in "
              f"{time.perf_counter() - t0:.1f} s")
        return 1 if problems else 0
    result = render(args.out, stems=args.stems or None, jobs=args.jobs)
    for stem, why in result["failed"].items():
        print(f"FAILED: {stem}.png could not be drawn: {why}")
    print(f"{len(result['written'])} figures written to {args.out}, "
          f"{len(result['skipped'])} skipped, {len(result['failed'])} failed, in "
          f"{time.perf_counter() - t0:.1f} s")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
