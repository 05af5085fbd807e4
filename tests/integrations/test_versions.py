"""The integrations extra's version bounds are the versions the lane tested: ``pyproject.toml``'s ``integrations``
extra admits exactly the minor version of transformers and accelerate in ``harness.recipes.libraries.TESTED_WITH``,
and ``scripts/integrations.sh`` pins torchtitan to its version there. These need no library and run in the default
lane; the last asserts, in the integrations lane, that the installed libraries are inside the bounds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.recipes.libraries import TESTED_WITH, installed_version
from harness.recipes.libraries._common import EXTRA_HINT

ROOT = Path(__file__).resolve().parents[2]
EXTRA_LIBRARIES = ("transformers", "accelerate")


def extra_requirements(pyproject: str) -> dict[str, str]:
    """Each requirement of the ``integrations`` extra as ``name -> specifier`` (``">=5.25,<5.26"``)."""
    found = re.search(r"^integrations = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL)
    assert found is not None, "pyproject.toml has no integrations extra"
    out = {}
    for requirement in re.findall(r'"([^"]+)"', found.group(1)):
        parsed = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement)
        assert parsed is not None, requirement
        out[parsed.group(1)] = parsed.group(2).replace(" ", "")
    return out


def minor_bounds(version: str) -> str:
    """The specifier admitting exactly ``version``'s minor series: ``5.25.0`` -> ``>=5.25,<5.26``."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return f">={major}.{minor},<{major}.{minor + 1}"


def admits(spec: str, version: str) -> bool:
    """Whether a ``>=a.b,<c.d`` specifier admits ``version`` (compared on major and minor)."""
    bounds = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", spec)
    assert bounds is not None, f"not a >=a.b,<c.d specifier: {spec}"
    a, b, c, d = (int(x) for x in bounds.groups())
    got = tuple(int(x) for x in version.split(".")[:2])
    return (a, b) <= got < (c, d)


def test_the_extra_admits_exactly_the_tested_minor_versions() -> None:
    requirements = extra_requirements((ROOT / "pyproject.toml").read_text())
    assert {name: minor_bounds(TESTED_WITH[name]) for name in EXTRA_LIBRARIES} == requirements


def test_integrations_sh_pins_the_tested_torchtitan() -> None:
    script = (ROOT / "scripts" / "integrations.sh").read_text()
    assert [TESTED_WITH["torchtitan"]] == re.findall(r'"torchtitan==([^"]+)"', script)


def test_a_wider_bound_is_not_the_tested_one() -> None:
    """The negative control: the extra's former ``>=5,<6`` is refused for transformers 5.25.0."""
    assert ">=5,<6" != minor_bounds("5.25.0")
    assert {"transformers": ">=5,<6"} == extra_requirements('integrations = ["transformers>=5,<6"]')
    assert not admits(">=5.25,<5.26", "5.26.0") and admits(">=5.25,<5.26", "5.25.3")


@pytest.mark.integrations
@pytest.mark.parametrize("library", EXTRA_LIBRARIES)
def test_the_installed_library_is_inside_the_extras_bounds(library: str) -> None:
    version = installed_version(library)
    if version is None:
        pytest.skip(EXTRA_HINT)
    spec = extra_requirements((ROOT / "pyproject.toml").read_text())[library]
    assert admits(spec, version), f"{library} {version} is outside the tested bounds {spec}: test it, then move " \
                                  f"TESTED_WITH and the extra together"
