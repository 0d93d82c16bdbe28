"""Notebook hygiene and authoring tools.

    python -m course_lib.nbtools strip notebooks/*.ipynb     # remove outputs and counts
    python -m course_lib.nbtools check notebooks/*.ipynb     # fail if any are left
    python -m course_lib.nbtools to-percent nb.ipynb > nb.py  # edit as a script ...
    python -m course_lib.nbtools from-percent nb.py nb.ipynb  # ... and write it back

The percent format marks cells with ``# %%`` (code) and ``# %% [markdown]`` (markdown; each
line of the cell starts with ``# ``), as jupytext and VS Code do.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def is_clean(nb: dict) -> bool:
    return not any(c.get("outputs") or c.get("execution_count")
                   for c in nb.get("cells", []) if c.get("cell_type") == "code")


def strip(nb: dict) -> dict:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        md = cell.get("metadata", {})
        for key in ("execution", "collapsed", "scrolled"):
            md.pop(key, None)
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def _write(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def from_percent(text: str) -> dict:
    """Build a clean notebook (nbformat 4) from percent-format source."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = list(lines)
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        if kind == "markdown":
            body = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body]
            cells.append({"cell_type": "markdown", "id": f"cell-{len(cells)}", "metadata": {},
                          "source": _src(body)})
        else:
            cells.append({"cell_type": "code", "execution_count": None, "id": f"cell-{len(cells)}",
                          "metadata": {}, "outputs": [], "source": _src(body)})

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return {"cells": cells, "metadata": {"kernelspec": KERNELSPEC,
                                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def _src(lines: list[str]) -> list[str]:
    return [ln + "\n" for ln in lines[:-1]] + lines[-1:] if lines else []


def to_percent(nb: dict) -> str:
    out = []
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            out.append("# %% [markdown]")
            out.extend(("# " + ln) if ln else "#" for ln in src.splitlines())
        else:
            out.append("# %%")
            out.extend(src.splitlines())
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.nbtools", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("strip", "check"):
        p = sub.add_parser(name)
        p.add_argument("paths", nargs="+", type=Path)
    p = sub.add_parser("to-percent")
    p.add_argument("path", type=Path)
    p = sub.add_parser("from-percent")
    p.add_argument("source", type=Path)
    p.add_argument("target", type=Path)
    args = ap.parse_args(argv)

    if args.cmd == "to-percent":
        sys.stdout.write(to_percent(json.loads(args.path.read_text(encoding="utf-8"))))
        return 0
    if args.cmd == "from-percent":
        _write(from_percent(args.source.read_text(encoding="utf-8")), args.target)
        return 0
    dirty = []
    for path in args.paths:
        nb = json.loads(path.read_text(encoding="utf-8"))
        if args.cmd == "strip":
            if not is_clean(nb) or "widgets" in nb.get("metadata", {}):
                _write(strip(nb), path)
                print(f"stripped {path}")
        elif not is_clean(nb):
            dirty.append(path)
    for path in dirty:
        print(f"{path} has outputs or execution counts: run ./course strip")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
