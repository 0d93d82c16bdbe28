"""The architecture picture of ARCHITECTURE.md, drawn from the import graph itself.

The layers come from the import-linter contract in pyproject.toml (``[tool.importlinter]``, the
contract ``lint-imports`` enforces), the imports from ``grimp`` (import-linter's graph builder),
the sizes from the files: so the picture cannot drift from the code. Each layer is a row of boxes,
one per room (a package or a top-level module) with its line count; an arrow from a row to a row
below says how many imports go that way. No import goes up: the contract would fail.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[2]
COURSE_LIB = ROOT / "course_lib"

#: One line per layer of the contract, top to bottom: what its rooms are for.
ROLES = (
    "tools: decks, browser, notebook hygiene, GPU check",
    "published numbers and figures",
    "diagrams drawn for lessons and slides",
    "lessons: exercises, widgets, Hugging Face, serving",
    "analysis of the kernels, for the lessons",
    "benchmarks (GPU) and their stored results",
    "public API: validated, differentiable ops",
    "kernels: @triton.jit code and launchers",
    "models: roofline, costs, KV cache",
    "I/O counts, test helpers, FP8 and KV-cache rounding",
    "references, hardware, softmax, input checks",
    "the variants' mask rules",
    "the device switch, the lesson map",
)


def layers() -> list[list[str]]:
    """The contract's layers, top first, each a list of module names."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [[m.strip() for m in layer.replace("|", ":").split(":")] for layer in contract["layers"]]


def layer_imports(rows: list[list[str]]) -> dict[tuple[int, int], int]:
    """{(importing layer, imported layer): number of module-to-module imports}."""
    import grimp

    graph = grimp.build_graph("course_lib")
    where = {}
    for i, row in enumerate(rows):
        for room in row:
            where[room] = i

    def layer(module: str):
        parts = module.split(".")
        for n in (3, 2):
            name = ".".join(parts[:n])
            if name in where:
                return where[name]
        return None

    counts: dict[tuple[int, int], int] = {}
    for module in graph.modules:
        a = layer(module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = layer(imported)
            if a is not None and b is not None and a != b:
                counts[(a, b)] = counts.get((a, b), 0) + 1
    return counts


def architecture_figure():
    rows = layers()
    counts = layer_imports(rows)
    fig = Figure(figsize=(13, 0.82 * len(rows) + 1.2), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 13)
    ax.set_ylim(-0.6, len(rows) - 0.2)
    ax.invert_yaxis()
    ax.axis("off")
    for i, row in enumerate(rows):
        width = 8.4 / len(row)
        for j, room in enumerate(row):
            x = 0.2 + j * width
            ax.add_patch(_box(x, i, width - 0.12))
            ax.text(x + (width - 0.12) / 2, i, room.removeprefix("course_lib."),
                    ha="center", va="center", fontsize=11, fontweight="bold")
        ax.text(8.8, i, ROLES[i] if i < len(ROLES) else "", va="center", fontsize=10.5)
    for a, b in sorted(counts):
        if b == a + 1:
            ax.annotate("", xy=(12.6, b - 0.3), xytext=(12.6, a + 0.3),
                        arrowprops={"arrowstyle": "->", "color": "0.35"})
    up = [k for k in counts if k[1] < k[0]]
    ax.set_title(f"course_lib: {len(rows)} layers; a room imports only from its layer or below "
                 f"({'none' if not up else len(up)} upwards)", fontsize=12, loc="left")
    return fig


def _box(x, y, w):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x, y - 0.36), w, 0.72, boxstyle="round,pad=0.02,rounding_size=0.08",
                          facecolor="#e8eef7", edgecolor="#1f3b63", lw=1.2)


FIGURES = {"architecture": architecture_figure}
"""The figure of ARCHITECTURE.md (images/architecture.png)."""
