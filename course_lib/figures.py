"""Every figure of the course, regenerated into images/ by one command.

    python -m course_lib.figures              # (re)write images/<stem>.png
    python -m course_lib.figures --check      # regenerate into a temporary folder, compare bytes
    python -m course_lib.figures --list       # every stem and the module that draws it
    python -m course_lib.figures STEM ...     # only these (no manifest is written)

The notebooks and the slides (slides/*.md, slides/zh/*.md) use these files. Each module listed in
``MODULES`` keeps a dict ``FIGURES = {"stem": fn}``; ``fn()`` returns a matplotlib Figure, or None
where the data it draws (a stored GPU measurement in course_lib/data/) is missing; such a stem is
skipped and reported. The measured figures are drawn from the stored benchmark JSON, never from a
live run, so this command needs no GPU and gives the same pictures everywhere.

Determinism. The Agg backend draws with the DejaVu Sans font bundled with matplotlib, at a fixed
dpi; PNGs are saved without the "Software" text chunk (which names the matplotlib version), and
matplotlib writes no date into a PNG. Two runs in the same environment give byte-identical files
(tests/test_figures.py checks it). The one documented exception: bytes depend on the versions of
matplotlib, its FreeType and NumPy, so ``images/MANIFEST.json`` records those versions with each
file's SHA-256, and ``--check`` compares bytes with a fresh render only where the versions are the
same; elsewhere it says so and checks that every file exists and matches the manifest.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib import ft2font

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
MANIFEST = "MANIFEST.json"

#: Every module with a module-level ``FIGURES`` dict (tests/test_figures.py checks the list is
#: complete). Order: roughly the lesson order, which is also the order of images/MANIFEST.json.
MODULES = (
    "course_lib.softmax",
    "course_lib.widgets.softmax_steps",
    "course_lib.roofline",
    "course_lib.iomodel.matmul",
    "course_lib.widgets.tiled_matmul",
    "course_lib.iomodel.attention",
    "course_lib.widgets.tile_walk",
    "course_lib.seed_sketch",
    "course_lib.kernels.flash_v2_plan",
    "course_lib.kernels.hopper_plan",
    "course_lib.bench.plots",
    "course_lib.iomodel.backward",
    "course_lib.bench.memory",
    "course_lib.iomodel.decode",
    "course_lib.widgets.split_kv",
    "course_lib.bench.decode",
    "course_lib.kvcache",
    "course_lib.unified_max",
    "course_lib.slides",
)

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


def collect(modules=MODULES) -> dict:
    """Stem -> (module name, function), in ``modules`` order; a stem defined twice is an error."""
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
    return found


def figure_png(fn) -> bytes | None:
    """Draw ``fn()`` and return its PNG bytes (None where ``fn`` returns None).

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
        finally:
            plt.close(fig)
    return buf.getvalue()


def render(out: Path, stems=None, verbose: bool = True) -> dict:
    """Write ``out/<stem>.png`` for every figure (or those in ``stems``) and the manifest.

    Returns {"written": {stem: sha256}, "skipped": {stem: reason}, "seconds": {stem: s}}.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = collect()
    if stems is not None:
        unknown = set(stems) - set(figures)
        if unknown:
            raise KeyError(f"unknown figure stems: {sorted(unknown)}")
    written, skipped, seconds = {}, {}, {}
    for stem, (module, fn) in figures.items():
        if stems is not None and stem not in stems:
            continue
        t0 = time.perf_counter()
        data = figure_png(fn)
        if data is None:
            skipped[stem] = (f"{module}: no data (a stored measurement in course_lib/data "
                             "is missing)")
            if verbose:
                print(f"  skipped {stem}: {skipped[stem]}")
            continue
        (out / f"{stem}.png").write_bytes(data)
        written[stem] = hashlib.sha256(data).hexdigest()
        seconds[stem] = time.perf_counter() - t0
        if verbose:
            print(f"  {stem + '.png':<34} {len(data) / 1024:6.0f} KiB  {seconds[stem]:5.2f} s"
                  f"  ({module})")
    if stems is None:
        manifest = {"generated_by": "python -m course_lib.figures", "versions": versions(),
                    "dpi": DPI, "figures": written}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    return {"written": written, "skipped": skipped, "seconds": seconds}


def check(images: Path = IMAGES) -> list[str]:
    """Regenerate into a temporary folder and compare with ``images``; the problems found."""
    images = Path(images)
    problems = []
    manifest_path = images / MANIFEST
    if not manifest_path.exists():
        return [f"{manifest_path} is missing: run python -m course_lib.figures"]
    manifest = json.loads(manifest_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        result = render(Path(tmp), verbose=False)
        fresh = result["written"]
        for stem in sorted(set(manifest["figures"]) - set(fresh)):
            problems.append(f"{stem}.png is in images/ but no FIGURES function draws it now")
        for stem in sorted(set(fresh) - set(manifest["figures"])):
            problems.append(f"{stem}.png is new: run python -m course_lib.figures")
        same_versions = manifest.get("versions") == versions()
        for stem in sorted(set(fresh) & set(manifest["figures"])):
            path = images / f"{stem}.png"
            if not path.exists():
                problems.append(f"{path} is missing")
                continue
            committed = path.read_bytes()
            if hashlib.sha256(committed).hexdigest() != manifest["figures"][stem]:
                problems.append(f"{stem}.png does not match images/{MANIFEST}")
            elif same_versions and committed != (Path(tmp) / f"{stem}.png").read_bytes():
                problems.append(f"{stem}.png differs from a fresh render: run "
                                "python -m course_lib.figures")
        if not same_versions:
            print(f"note: images/ were made with {manifest.get('versions')}, this environment "
                  f"has {versions()}: bytes are compared only between equal versions")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.figures",
                                     description="Regenerate every course figure into images/.")
    parser.add_argument("--out", type=Path, default=IMAGES, help="output folder (images/)")
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary folder and compare bytes with --out")
    parser.add_argument("--list", action="store_true", help="list the stems and their modules")
    parser.add_argument("stems", nargs="*", help="only these stems (no manifest is written)")
    args = parser.parse_args(argv)
    plt.switch_backend("Agg")  # headless, and the renderer the bytes were made with
    t0 = time.perf_counter()
    if args.list:
        for stem, (module, _) in collect().items():
            print(f"{stem:<30} {module}")
        return 0
    if args.check:
        problems = check(args.out)
        for p in problems:
            print("DIFFERENT:", p)
        print(f"{'OK' if not problems else 'FAILED'}: {args.out} checked in "
              f"{time.perf_counter() - t0:.1f} s")
        return 1 if problems else 0
    result = render(args.out, stems=args.stems or None)
    print(f"{len(result['written'])} figures written to {args.out}, "
          f"{len(result['skipped'])} skipped, in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
