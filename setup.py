"""Package discovery; everything else about the project is in pyproject.toml.

pyproject.toml's [tool.setuptools.package-dir] maps each source folder to the package it installs
as (backends/ as longmoe.backends, tuning/ as longmoe.tuning). setuptools' own `find` cannot put
a folder under another package's name, so the packages are found here instead: every folder with
an `__init__.py` under a mapped folder, named under its mapped package. Nothing outside those
folders (tests/, bench/, examples/) is installed, and a new subpackage needs no list entry.
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # build-system requires tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """Installed package name -> source folder (relative to the repository root)."""
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def discover_packages(root: Path = ROOT) -> list[str]:
    """Every package the distribution installs, by its installed name."""
    found = set()
    for name, folder in package_dirs(root).items():
        found.add(name)
        found.update(f"{name}.{sub}" for sub in find_packages(str(root / folder)))
    return sorted(found)


# setuptools runs this file as __main__; the tests import it for discover_packages.
if __name__ == "__main__":
    setup(packages=discover_packages())
