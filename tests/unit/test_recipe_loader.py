"""The one recipe loader: instances, classes and factories load; every bad path is a usage error naming the fix."""

from __future__ import annotations

import pytest

from harness.recipes import GlobalTokenMean, RecipeError, global_token_mean, load_recipe, recipe_module


def test_an_instance_loads_as_it_is() -> None:
    """``pkg.mod:instance`` returns that very object."""
    assert global_token_mean is load_recipe("harness.recipes:global_token_mean")


def test_a_class_is_instantiated_even_though_it_has_a_backward_window_attribute() -> None:
    """A class's backward_window is an unbound function: the loader builds an instance instead of returning it."""
    recipe = load_recipe("harness.recipes:GlobalTokenMean")
    assert isinstance(recipe, GlobalTokenMean)


def test_a_class_with_state_gets_a_fresh_instance_per_load() -> None:
    """Each rank (each load) builds its own object, so state kept across windows is the rank's own."""
    assert load_recipe("user_recipes.variants:ClassRecipe") is not load_recipe("user_recipes.variants:ClassRecipe")


def test_a_zero_argument_factory_is_called() -> None:
    """``pkg.mod:make_recipe`` returns what the factory built."""
    assert "factory_recipe" == load_recipe("user_recipes.variants:make_recipe").name


def test_objects_load_like_paths_and_none_is_the_correct_recipe() -> None:
    """The trainer passes objects, classes or None through the same loader."""
    assert global_token_mean is load_recipe(None)
    assert isinstance(load_recipe(GlobalTokenMean), GlobalTokenMean)
    assert global_token_mean is load_recipe(global_token_mean)


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("no_such_package.module:attr", "importing 'no_such_package.module' failed"),
        ("harness.recipes:no_such_attr", "has no attribute 'no_such_attr'"),
        ("harness.recipes", "must look like 'package.module:attr'"),
        ("harness.recipes:MeanOfLocalMeans.name", "has no backward_window"),
        ("user_recipes.variants:RaisesOnEveryRank", "calling RaisesOnEveryRank() to build the recipe failed"),
    ],
    ids=["missing-module", "missing-attr", "no-colon", "not-a-recipe", "factory-raises"],
)
def test_a_bad_recipe_is_a_usage_error_naming_the_path_and_the_fix(path: str, says: str) -> None:
    """Every failure names the path and what to change."""
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert says in str(info.value) and repr(path) in str(info.value)


def test_a_recipe_without_a_name_is_refused() -> None:
    """Reports need a name: an object without a str ``name`` is refused with the contract's wording."""

    class Nameless:
        def backward_window(self, model: object, window: object) -> None:
            return None

    with pytest.raises(RecipeError, match="needs a `name` attribute"):
        load_recipe(Nameless)


def test_the_module_of_a_path_is_what_the_launcher_preloads() -> None:
    """Only import paths have a module to preload; objects have none."""
    assert "user_recipes.variants" == recipe_module("user_recipes.variants:ClassRecipe")
    assert recipe_module(global_token_mean) is None
