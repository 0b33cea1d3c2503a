"""The two install routes (pip via pyproject.toml, conda via environment.yml) name the same packages."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# conda-forge names that differ from the PyPI names.
CONDA_TO_PYPI = {"pytorch": "torch"}


def _split(spec: str) -> tuple[str, str]:
    spec = spec.split(";")[0].strip()  # drop environment markers such as "; sys_platform == 'linux'"
    name, version = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec).groups()
    return name.lower().replace("_", "-"), version.replace(" ", "")


def test_environment_yml_matches_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    pip_deps = dict(_split(s) for s in pyproject["project"]["dependencies"] + [d for group in extras.values() for d in group])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_deps = {}
    for item in env["dependencies"]:
        if isinstance(item, str) and not item.startswith(("python", "pip")):
            name, version = _split(item)
            conda_deps[CONDA_TO_PYPI.get(name, name)] = version
    assert conda_deps == pip_deps, (
        f"environment.yml and pyproject.toml disagree: only in environment.yml "
        f"{sorted(set(conda_deps.items()) - set(pip_deps.items()))}, only in pyproject.toml "
        f"{sorted(set(pip_deps.items()) - set(conda_deps.items()))}"
    )
    python = next(s for s in env["dependencies"] if isinstance(s, str) and s.startswith("python"))
    assert python == f"python{pyproject['project']['requires-python']}"


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
