"""images/: every figure comes from course_lib code (python -m course_lib.figures), reproducibly.

- ``course_lib.figures.MODULES`` lists every module that defines a module-level ``FIGURES``;
- drawing a figure twice gives the same PNG bytes, without the matplotlib version in them;
- every ``images/<stem>.png`` that a slide deck or a notebook links to exists and is drawn by a
  ``FIGURES`` function (no hand-made or pasted images), and images/ holds nothing else;
- images/ equals a fresh render: the same texts and geometry (any environment) and pixels that
  look the same (where matplotlib and FreeType are the manifest's versions), also when torch and
  NumPy take the code paths of other CPUs, and not when a figure really changes.
"""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import figures

ROOT = Path(__file__).resolve().parent.parent
IMAGE_LINK = re.compile(r"(?:\.\./)*images/([\w.-]+\.png)")
CHEAP = ("06_block_size_sweep", "08_causal_block_kinds", "06_sketch_pitfalls")


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
    manifest = figures.load_manifest()
    stems = set(figures.collect())
    on_disk = {p.name for p in figures.IMAGES.iterdir()}
    assert on_disk - {figures.MANIFEST} == {f"{s}.png" for s in manifest["figures"]}
    assert set(manifest["figures"]) <= stems, "images/ holds a figure no module draws any more"
    for stem, entry in manifest["figures"].items():
        data = (figures.IMAGES / f"{stem}.png").read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], \
            f"{stem}.png differs from the manifest"
        assert entry["content"]["texts"], f"{stem}: no text recorded"


def test_images_equal_a_fresh_render():
    """Content always; pixels where matplotlib and FreeType are the manifest's versions."""
    problems = figures.check()
    assert not problems, "\n".join(problems)


def test_the_chinese_decks_show_chinese_figures():
    """Every figure an English deck shows has its Chinese twin in images/, no text of a twin is
    left in English (course_lib/data/figures_zh.json translates them), and the Chinese decks
    show the twins."""
    stored = figures.load_manifest()["figures"]
    problems = []
    for stem in figures.deck_stems():
        entry = stored.get(stem + figures.ZH_SUFFIX)
        if entry is None:
            problems.append(f"{stem}{figures.ZH_SUFFIX}.png is missing: run "
                            "python -m course_lib.figures")
            continue
        left = figures.untranslated(entry["content"]["texts"])
        if left:
            problems.append(f"{stem}{figures.ZH_SUFFIX}: still in English: {left}")
    for path in sorted((ROOT / "slides" / "zh").glob("*.md")):
        for name in IMAGE_LINK.findall(path.read_text()):
            if not Path(name).stem.endswith(figures.ZH_SUFFIX):
                problems.append(f"slides/zh/{path.name} shows {name}, not its Chinese twin")
    assert not problems, "\n".join(problems)


# --- the check holds on other CPUs ------------------------------------------------------------
# The last bits of a computed number depend on the CPU's SIMD code paths: torch's ATen kernels
# (ATEN_CPU_CAPABILITY), NumPy's loops (NPY_DISABLE_CPU_FEATURES), the BLAS under NumPy
# (OPENBLAS_CORETYPE) and under torch (MKL_CBWR), and the number of threads. Each variable
# below makes this machine take the code path of another CPU; the committed images were made on
# yet another. (On this kind of machine OPENBLAS_CORETYPE=Haswell alone turned the split-KV
# figure's old title "|merged − reference| = 5.6e-17" into "2.8e-17".)

def _numpy_dispatch() -> str:
    import numpy._core._multiarray_umath as umath

    return ",".join(umath.__cpu_dispatch__)


OTHER_CPUS = {
    "baseline SIMD, one thread": ({"ATEN_CPU_CAPABILITY": "default",
                                   "NPY_DISABLE_CPU_FEATURES": _numpy_dispatch(),
                                   "OPENBLAS_CORETYPE": "Sandybridge",
                                   "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}, 1),
    "best SIMD, every thread": ({"OPENBLAS_CORETYPE": "Haswell",
                                 "OMP_NUM_THREADS": str(os.cpu_count())}, os.cpu_count()),
}


@pytest.mark.parametrize("cpu", list(OTHER_CPUS))
def test_check_passes_on_other_cpu_code_paths(cpu):
    env_vars, threads = OTHER_CPUS[cpu]
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE",
                        "MKL_CBWR", "OMP_NUM_THREADS")}
    env.update(env_vars, MPLBACKEND="Agg")
    code = ("import sys, torch; from course_lib import figures; "
            f"torch.set_num_threads({threads}); "
            "print('capability', torch.backends.cpu.get_cpu_capability(), 'threads', "
            "torch.get_num_threads()); sys.exit(figures.main(['--check', '--english']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"{cpu}: {proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    if cpu.startswith("baseline"):
        assert "capability DEFAULT threads 1" in proc.stdout


# --- the check fails when what a figure says changes -----------------------------------------

def _toy(label="speed-up 1.40×", shift=0.0, color="C0", noise=0.0, title="measured on a GPU"):
    """A small figure: a curve, bars, a placed label; each argument changes one thing."""
    import numpy as np
    from matplotlib.figure import Figure

    def draw():
        x = np.linspace(0, 1, 50)
        y = np.sin(3 * x) * (1 + noise) + shift
        fig = Figure(figsize=(4, 3), layout="constrained")
        ax = fig.subplots()
        ax.plot(x, y, color=color)
        ax.bar([0.2, 0.5, 0.8], [0.3, 0.6, 0.9 * (1 + noise)], width=0.1, color="C1")
        ax.text(0.1, 0.9, label)
        ax.set(title=title, ylim=(-0.5, 1.5))
        return fig
    return {"toy": ("tests", draw)}


@pytest.fixture(scope="module")
def toy_images(tmp_path_factory):
    out = tmp_path_factory.mktemp("images")
    figures.render(out, figures=_toy(), verbose=False)
    return out


@pytest.mark.parametrize("change, expect", [
    ({"label": "speed-up 1.41×"}, "texts changed"),             # a number at its precision
    ({"title": "measured on a CPU"}, "texts changed"),           # a label
    ({"shift": 0.01}, "line 0: xy moved"),                       # a curve, by 1% of the axes
    ({"color": "C2"}, "colour"),                                 # a style
])
def test_check_fails_on_a_changed_figure(toy_images, change, expect):
    problems = figures.check(toy_images, figures=_toy(**change))
    print("\n".join(problems))
    assert any(expect in p for p in problems), problems
    assert any("looks different" in p for p in problems), "the pixel comparison missed it"


def test_check_ignores_rounding_noise(toy_images):
    """Data changed in its last bits (as another CPU computes it) is the same figure."""
    assert figures.check(toy_images, figures=_toy(noise=1e-13)) == []
    assert figures.check(toy_images, figures=_toy()) == []


def test_pixels_alone_see_a_changed_digit():
    """Where matplotlib's version differs only content is compared; where it is the same the
    pixels alone must also catch a changed digit (and ignore a redraw)."""
    one, other = _toy()["toy"][1], _toy(label="speed-up 1.41×")["toy"][1]
    assert figures.compare_pixels(figures.figure_png(one), figures.figure_png(one)) is None
    assert figures.compare_pixels(figures.figure_png(one), figures.figure_png(other))


def test_a_real_figure_changed_by_one_label_fails(monkeypatch):
    stem = "06_block_size_sweep"
    module, fn = figures.collect()[stem]

    def changed():
        fig = fn()
        fig.axes[0].set_xlabel(fig.axes[0].get_xlabel() + " ")  # one trailing space
        return fig
    problems = figures.check(stems=[stem], figures={stem: (module, changed)})
    assert any(f"{stem}.png: texts changed" in p for p in problems), problems


# --- worker processes draw what this process draws --------------------------------------------

def test_worker_processes_draw_what_this_process_draws():
    """The check draws in spawned worker processes (one per CPU): the same PNG bytes and the same
    content as drawing in this process, gathered in the manifest's order, a Chinese twin too."""
    twin = next(s for s in figures.collect() if s.endswith(figures.ZH_SUFFIX))
    stems = [*CHEAP[:2], twin]
    here, skipped_here, failed_here = figures._draw_all(stems, jobs=1)
    there, skipped, failed = figures._draw_all(stems, jobs=2)
    assert not failed and not failed_here, (failed, failed_here)
    assert skipped == skipped_here
    assert list(there) == list(here) == [s for s in figures.collect() if s in set(there)]
    for stem in here:
        assert there[stem][0] == here[stem][0], f"{stem}: the PNG bytes differ"
        assert there[stem][1] == here[stem][1], f"{stem}: the content differs"


def test_a_figure_that_raises_is_reported_by_its_stem(tmp_path):
    def broken():
        raise ZeroDivisionError("no data")

    found = {**_toy(), "broken": ("tests", broken)}
    result = figures.render(tmp_path, figures=found, verbose=False)
    assert list(result["written"]) == ["toy"]
    assert "ZeroDivisionError: no data" in result["failed"]["broken"]
    problems = figures.check(tmp_path, figures=found)
    assert len(problems) == 1 and problems[0].startswith("broken.png could not be drawn: tests: "
                                                         "raised ZeroDivisionError"), problems
