"""The keywords the harness passes a recipe are read off its signatures: ``max_norm`` to one that clips, ``mesh`` to
one whose ``backward_window`` (or ``setup``) takes it, nothing to one that takes neither."""

from __future__ import annotations

from typing import Any

from harness.recipes import global_token_mean, mesh_token_mean
from harness.recipes.contract import clips, setup_takes_mesh, takes_mesh


class Both:
    name = "both"

    def setup(self, mesh: Any = None) -> None: ...

    def backward_window(self, model: Any, window: Any, max_norm: float = 1.0, mesh: Any = None) -> None: ...


class Neither:
    name = "neither"

    def setup(self) -> None: ...

    def backward_window(self, model: Any, window: Any, **_: Any) -> None: ...


def test_a_recipe_that_names_the_keywords_receives_them() -> None:
    """A signature with ``max_norm`` and ``mesh`` (and a setup with ``mesh``) is read as taking all three."""
    assert (True, True, True) == (clips(Both()), takes_mesh(Both()), setup_takes_mesh(Both()))


def test_a_recipe_that_does_not_name_them_receives_neither() -> None:
    """Its control: a catch-all ``**kwargs`` is not a request for a mesh or a norm, and the shipped correct recipe
    takes none; the mesh recipe takes the mesh only."""
    assert (False, False, False) == (clips(Neither()), takes_mesh(Neither()), setup_takes_mesh(Neither()))
    assert (False, False) == (clips(global_token_mean), takes_mesh(global_token_mean))
    assert (False, True) == (clips(mesh_token_mean), takes_mesh(mesh_token_mean))
