"""The controls' catalog registers itself: a control is one decorated class, and the tables come from the classes."""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path

import pytest

from harness.recipes import CONTROLS, DIAGNOSES, SCENARIO_CONTROLS, catalog, controls
from harness.recipes.catalog import Target, control


def unregistered(module: types.ModuleType) -> list[str]:
    """Classes of ``module`` shaped like a recipe (a ``backward_window`` and a ``name``) that no ``@control``
    registered."""
    registered = {e.cls for e in catalog.REGISTRY.values()}
    return sorted(name for name, obj in vars(module).items()
                  if inspect.isclass(obj) and obj.__module__ == module.__name__
                  and callable(getattr(obj, "backward_window", None)) and isinstance(getattr(obj, "name", None), str)
                  and obj not in registered)


def test_every_control_class_is_registered() -> None:
    """No control in any family module of harness.recipes.controls is defined and silently never run."""
    assert [] == [f"{m.__name__}.{n}" for m in controls.FAMILIES for n in unregistered(m)]


def unlisted(folder: Path, families: tuple[types.ModuleType, ...]) -> list[str]:
    """Modules in the controls package's folder that :data:`harness.recipes.controls.FAMILIES` does not import (their
    classes would never register)."""
    listed = {m.__name__.rsplit(".", 1)[-1] for m in families}
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__" and p.stem not in listed)


def test_every_family_module_is_imported(tmp_path: Path) -> None:
    """A new family file must be listed in FAMILIES; the control: a copy of the folder with one more file is
    reported."""
    folder = Path(controls.__file__).parent
    assert [] == unlisted(folder, controls.FAMILIES)
    for f in folder.glob("*.py"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "optimizers.py").write_text("")
    assert ["optimizers"] == unlisted(tmp_path, controls.FAMILIES)


def test_the_registration_check_finds_a_control_without_its_decorator() -> None:
    """Its negative control: a recipe-shaped class without @control is reported by name."""
    fake = types.ModuleType("fake_controls")
    exec("class Forgotten:\n    name = 'forgotten'\n    def backward_window(self, model, window): pass\n",
         fake.__dict__)
    assert ["Forgotten"] == unregistered(fake)


def test_every_registered_control_is_importable_by_its_name_and_in_every_table() -> None:
    """harness.recipes:<name> names it, and CONTROLS and DIAGNOSES hold it: the negative-control tests, which
    iterate CONTROLS, run every registered control."""
    import harness.recipes

    for name, entry in catalog.REGISTRY.items():
        obj = getattr(harness.recipes, name)
        assert obj is entry.cls or isinstance(obj, entry.cls), name
        assert entry.target == CONTROLS[name] == entry.cls.target  # type: ignore[attr-defined]
        assert entry.diagnosis == DIAGNOSES[name]
    assert set(CONTROLS) == set(catalog.REGISTRY)


def test_each_scenario_but_the_base_one_has_the_control_only_it_catches() -> None:
    """Derived from the classes' declarations: one per scenario, each targeting its own scenario."""
    assert {"single", "long", "varying", "sparse", "one_empty", "all_empty"} == set(SCENARIO_CONTROLS)
    for scenario, name in SCENARIO_CONTROLS.items():
        assert scenario == CONTROLS[name].scenario


def test_a_second_control_under_a_taken_name_is_refused() -> None:
    """Two classes cannot claim one name: the second registration raises, naming both."""
    class Twin:
        name = "mean_of_local_means"

        def backward_window(self, model: object, window: object) -> None:
            return None

    with pytest.raises(ValueError, match="registered twice"):
        control(Target("parity", "uneven"), "mean_of_local_means")(Twin)


def test_a_target_says_where_a_world_size_mistake_is_judged() -> None:
    """Declared world sizes are judged whatever is offered (at another W the mistake is right); undeclared: every
    offered W from 2 on. The world family declares W=4, and the node-local count a launch across nodes."""
    assert (4,) == Target("parity", "uneven", world_sizes=(4,)).judged_at((2,))
    assert (2, 3) == Target("parity", "uneven").judged_at((1, 2, 3))
    assert (4,) == CONTROLS["hard_coded_world_size"].world_sizes == CONTROLS["averaged_count"].world_sizes
    assert "torchrun-nodes" == CONTROLS["count_over_local_ranks"].launch
    assert {"in-process"} == {t.launch for n, t in CONTROLS.items() if n != "count_over_local_ranks"}


def test_a_target_whose_library_is_not_installed_is_unavailable_saying_what_to_install() -> None:
    """A control whose mistake lives in a library is not run where the library is missing, and the reason names it
    and the install; without a library, or with one installed (torch), it is available."""
    assert "its target needs no_such_library_here, which is not installed (pip install .[integrations]" in str(
        catalog.unavailable(Target("parity", "uneven", library="no_such_library_here")))
    assert catalog.unavailable(Target("parity", "uneven", library="torch")) is None
    assert catalog.unavailable(Target("parity", "uneven")) is None
    assert "transformers" == CONTROLS["trainer_router_loss_per_microbatch"].library


def test_a_target_on_a_mesh_is_judged_at_the_mesh_world_size() -> None:
    """A mistake of a mesh's groups is judged on its mesh: the mesh sets the world size, whatever is offered."""
    t = Target("parity", "uneven", mesh="dp=2,cp=2")
    assert (4,) == t.world_sizes == t.judged_at((2, 3))
    assert t.layout is not None and ("dp", "cp") == t.layout.names
    assert Target("parity", "uneven").layout is None


@pytest.mark.parametrize(("fields", "says"), [
    ({"world_sizes": (1,)}, "Target(world_sizes=(1,)) must be a tuple of world sizes >= 2"),
    ({"world_sizes": [4]}, "Target(world_sizes=[4]) must be a tuple"),
    ({"launch": "ssh"}, "Target(launch='ssh') must be one of 'in-process', 'torchrun-nodes'"),
    ({"mesh": "dp=2,cp"}, "Target(mesh=...)='dp=2,cp': 'cp' is not NAME=SIZE"),
    ({"mesh": "dp=2,cp=2", "world_sizes": (2,)}, "the mesh has 4 ranks; leave world_sizes out"),
])
def test_a_bad_target_is_refused_naming_the_field(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Target("parity", "uneven", **fields)  # type: ignore[arg-type]
