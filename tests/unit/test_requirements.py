"""The declared dependencies: the minimum environment pins exactly their lower bounds, and whatever stack this
run tests satisfies them (on Colab's and Kaggle's stacks the project is installed with --no-deps, as a user's
`pip install accel-magic` in a running kernel keeps the runtime's packages)."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPENDENCIES = [Requirement(text) for text in PROJECT["dependencies"]]


def lower_bound(specifier: SpecifierSet) -> str:
    (bound,) = [s.version for s in specifier if s.operator == ">="]
    return bound


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return found


def test_every_dependency_declares_a_lower_bound_that_the_minimum_environment_pins_exactly() -> None:
    minimum = pins(ROOT / "requirements/minimum.txt")
    for requirement in DEPENDENCIES:
        bound = lower_bound(requirement.specifier)
        assert minimum.get(requirement.name.lower()) is not None, f"{requirement.name} is missing from minimum.txt"
        assert Version(minimum[requirement.name.lower()]) == Version(bound), (
            f"minimum.txt pins {requirement.name}=={minimum[requirement.name.lower()]}, pyproject says >={bound}"
        )


def test_each_environment_names_its_python_and_the_minimum_one_is_the_lowest_declared() -> None:
    first_lines = {p.name: p.read_text().splitlines()[0] for p in (ROOT / "requirements").glob("*.txt")}
    assert all(re.fullmatch(r"# python 3\.\d+", line) for line in first_lines.values()), first_lines
    assert first_lines["minimum.txt"] == f"# python {lower_bound(SpecifierSet(PROJECT['requires-python']))}"


def test_this_stack_satisfies_every_declared_dependency() -> None:
    assert Version(".".join(map(str, sys.version_info[:3]))) in SpecifierSet(PROJECT["requires-python"])
    unsatisfied = []
    for requirement in DEPENDENCIES:
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            unsatisfied.append(f"{requirement} (not installed)")
            continue
        # a local build tag (2.11.0+cpu) satisfies the release it builds
        if not requirement.specifier.contains(Version(installed).public, prereleases=True):
            unsatisfied.append(f"{requirement} (installed: {installed})")
    assert not unsatisfied, "this stack does not satisfy: " + "; ".join(unsatisfied)
