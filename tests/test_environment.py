"""environment.yml (conda) and pyproject.toml (pip) declare the same dependencies."""
import re

try:
    import tomllib
except ImportError:  # Python 3.10: pip carries a copy of tomli
    from pip._vendor import tomli as tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _split(spec: str) -> tuple[str, str]:
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)$", spec)
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def pip_dependencies() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += list(extra)
    return dict(_split(s) for s in specs)


def conda_dependencies() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = {}
    for item in env["dependencies"]:
        if isinstance(item, dict):
            deps.update(_split(s) for s in item["pip"])
        else:
            name, spec = _split(item)
            if name not in ("python", "pip"):
                deps[name] = spec
    return deps


def test_environment_yml_matches_pyproject():
    pip, conda = pip_dependencies(), conda_dependencies()
    assert set(pip) == set(conda), (
        f"only in pyproject: {sorted(set(pip) - set(conda))}; "
        f"only in environment.yml: {sorted(set(conda) - set(pip))}")
    assert pip == conda, {k: (pip[k], conda[k]) for k in pip if pip[k] != conda[k]}


def test_python_versions_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python{project['requires-python']}" in env["dependencies"]
