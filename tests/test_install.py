"""`import flashllm` works from any directory, the clone's parent included: there a checkout named `flashllm/`
(no __init__.py) is a namespace package candidate, which must not win over the installed package. Checked for a
regular install and for the README's editable install (setuptools' strict editable mode: a link tree on sys.path;
the default mode's import finder runs after the path search and loses to that namespace package)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what a build needs: the package, the folders installed as flashllm.converters and flashllm.predictors, and the
# files pyproject.toml names (the embedded models in flashllm/data are left out: they only make the copy slower)
SOURCES = ("pyproject.toml", "README.md", "flashllm", "converters", "predictors")

# run with -S: the install under test first on the path, then the environment's own site directories (whose
# editable install of this checkout must not be what is found)
CHECK = ("import site, sys; [site.addsitedir(p) for p in sys.argv[1:]]; import flashllm; flashllm.load; "
         "import flashllm.converters, flashllm.predictors.train; print(flashllm.__file__)")


def _setuptools_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("setuptools").split(".")[:2] if p.isdigit())


def _not_source(directory: str, names: list[str]) -> list[str]:
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "data")(directory, names)
    return [*skip, *(n for n in names if os.path.islink(os.path.join(directory, n)))]


@pytest.fixture
def source(tmp_path) -> Path:
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed to install the package")
    if _setuptools_version() < (64,):
        pytest.skip("setuptools 64 or later builds editable installs from pyproject.toml")
    src = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=_not_source)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


def _install(src: Path, target: Path, *options: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--target", str(target), *options, str(src)],
                          capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _import_from_a_clones_parent(tmp_path: Path, site_dir: Path) -> Path:
    """Where `import flashllm` finds the package when run in a directory holding a `flashllm/` checkout folder
    without __init__.py (as the clone's parent does); the installed site directory is on the path like site-packages."""
    parent = tmp_path / "parent"
    (parent / "flashllm").mkdir(parents=True)  # a clone: pyproject.toml, README.md, ... but no __init__.py
    (parent / "flashllm" / "README.md").write_text("a checkout\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    import site

    proc = subprocess.run([sys.executable, "-S", "-c", CHECK, str(site_dir), *site.getsitepackages()], cwd=parent, capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip())


def test_import_from_a_clones_parent_after_a_regular_install(source, tmp_path):
    target = tmp_path / "site"
    _install(source, target)
    assert _import_from_a_clones_parent(tmp_path, target) == target / "flashllm" / "__init__.py"


def test_import_from_a_clones_parent_after_the_readmes_editable_install(source, tmp_path):
    target = tmp_path / "site"
    _install(source, target, "--config-settings", "editable_mode=strict", "--editable")
    found = _import_from_a_clones_parent(tmp_path, target)
    assert found.resolve() == (source / "flashllm" / "__init__.py").resolve()  # the checkout's own file, linked
