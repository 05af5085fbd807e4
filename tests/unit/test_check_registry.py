"""The battery's checks register themselves: a check is one decorated function in ``harness/battery/judge/checks.py``,
and the plan's order and lanes come from the registry."""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.judge.registry import CHECKS, REGISTRY, check
from harness.battery.judge.verdict import Verdict, passed
from harness.battery.launch.run import Run
from harness.battery.plan import cases as plan
from harness.recipes import CONTROLS


def unregistered(module: types.ModuleType) -> list[str]:
    """Public functions of ``module`` shaped like a check (one argument annotated ``Run``, returning a ``Verdict``)
    that no ``@check`` registered."""
    registered = {info.fn.__wrapped__ for info in REGISTRY.values()}  # type: ignore[attr-defined]
    found = []
    for name, obj in vars(module).items():
        if not inspect.isfunction(obj) or name.startswith("_") or obj.__module__ != module.__name__:
            continue
        sig = inspect.signature(obj)
        names = [str(p.annotation).strip("'\"") for p in sig.parameters.values()]
        shaped = names == ["Run"] and str(sig.return_annotation).strip("'\"") == "Verdict"
        if shaped and obj not in registered and getattr(obj, "__wrapped__", None) not in registered:
            found.append(name)
    return sorted(found)


@pytest.fixture
def scratch_check() -> Iterator[str]:
    """A check registered for one test, removed after it."""
    name = "scratch_probe"

    @check(per_precision=True)
    def scratch_probe(run: Run) -> Verdict:
        return passed(name, run, "nothing to see")

    yield name
    del REGISTRY[name], CHECKS[name]


def test_every_check_function_is_registered() -> None:
    assert [] == unregistered(checks)


def test_the_registration_check_finds_a_check_without_its_decorator() -> None:
    """Its negative control: a check-shaped function without @check is reported by name."""
    fake = types.ModuleType("fake_checks")
    exec("def forgotten(run: 'Run') -> 'Verdict':\n    return None\n", fake.__dict__)
    fake.__dict__["forgotten"].__module__ = "fake_checks"
    assert ["forgotten"] == unregistered(fake)


def test_the_plan_follows_the_registry() -> None:
    """Order by check is the registry's order; each check's lanes and scenarios are the ones it registered."""
    cases = plan.cases(precision="both")
    seen = list(dict.fromkeys(c.check for c in cases))
    assert seen == list(REGISTRY)
    for info in REGISTRY.values():
        mine = [c for c in cases if c.check == info.name]
        assert {c.precision for c in mine} == ({"fp32", "fp64"} if info.per_precision else {"fp32"})
        assert {c.scenario for c in mine} == {s for s in scenarios.BATTERY_SCENARIOS if info.runs_on(s)}


def test_a_new_check_is_one_decorated_function(scratch_check: str) -> None:
    """Registered, it is in CHECKS and in every precision of every scenario with tokens, after the others."""
    cases = plan.cases(world_sizes=(2,), precision="both")
    mine = [c for c in cases if c.check == scratch_check]
    assert {(c.scenario, c.precision) for c in mine} == {
        (s, p) for s in scenarios.BATTERY_SCENARIOS if s != "all_empty" for p in ("fp32", "fp64")}
    assert cases[-len(mine):] == mine
    assert scratch_check in CHECKS


CONTROLLED_ELSEWHERE = {
    "ranks_agree": ("tests/distributed/test_negative_controls.py",
                    "test_ranks_agree_rejects_ranks_that_step_from_different_weights"),
}
"""Checks whose negative control is not a recipe in the catalog, and the test that shows it failing: DDP makes the
ranks' gradients equal, so ranks that disagree are built from a run's records with one rank's weights skewed."""


def uncontrolled() -> set[str]:
    """Registered checks that no catalog control targets and no test listed in CONTROLLED_ELSEWHERE shows failing."""
    targeted = {t.check for t in CONTROLS.values()}
    root = Path(__file__).resolve().parents[2]
    shown = {name for name, (path, test) in CONTROLLED_ELSEWHERE.items()
             if f"def {test}(" in (root / path).read_text() and f"checks.{name}(" in (root / path).read_text()}
    return set(REGISTRY) - targeted - shown


def test_every_check_has_a_negative_control_aimed_at_it() -> None:
    """A check no control targets is a check nobody has seen fail."""
    assert set() == uncontrolled()


def test_a_check_without_a_negative_control_is_reported(scratch_check: str) -> None:
    """The control of the one above: a newly registered check that nothing is aimed at is named."""
    assert {scratch_check} == uncontrolled()


@pytest.mark.parametrize(("kwargs", "needle"), [({"scenarios": "some"}, "scenarios='some' must be one of")])
def test_a_bad_registration_is_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check(**kwargs)  # type: ignore[arg-type]


def test_a_second_check_under_a_taken_name_is_refused() -> None:
    def parity(run: Run) -> Verdict:
        raise AssertionError

    with pytest.raises(ValueError, match="'parity' is already registered"):
        check()(parity)
    assert REGISTRY["parity"].fn is CHECKS["parity"]
