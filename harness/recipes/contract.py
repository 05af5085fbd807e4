"""The recipe contract: the :class:`Recipe` protocol and the one loader that turns ``package.module:attr`` into a
recipe on every rank (an instance, a class, or a zero-argument factory), with usage errors that name the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import nn

from harness.core.microbatch import Microbatch
from harness.core.paths import resolve


@runtime_checkable
class Recipe(Protocol):
    """One optimizer step's gradient, run on every rank (docs/recipe-contract.md): ``backward_window`` leaves in
    ``.grad`` the gradient of the global token mean over every rank's window and may return that mean (a float or a
    0-d tensor, judged at the tolerances of its dtype). On a window without any supervised token it raises
    ``ValueError`` on every rank, or leaves zero gradients (or none) and no NaN or inf on every rank; either way the
    decision is the global count's, so that no rank is left in a collective."""

    name: str

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None: ...



class RecipeError(ValueError):
    """A recipe that cannot be loaded: a bad import path, an import error, a factory that raised, or an object that
    does not satisfy the contract (``backward_window`` and ``name``)."""


class ContractViolation(RuntimeError):
    """Raised inside a rank when a recipe does what the contract forbids and the harness cannot judge past it (it
    registered its own DDP communication hook). Not a ValueError: that is the contract's answer to an empty window."""


COMM_HOOK_OWNED = (
    "the recipe called register_comm_hook on the model: the harness already registered its own DDP communication "
    "hook, which counts the synchronizations of each window (the one_sync check) and reduces like DDP's default "
    "(a DDP model takes one hook: a second raises 'can only be called once'). Remove the call from "
    "backward_window/setup: to check a recipe written for a summing reduction, run it with reduction='sum' "
    "(harness.battery.launch.runner.run_windows), which makes the harness's hook sum instead of average; a hook that "
    "compresses gradients is outside what the battery checks")
"""The message of the usage error a recipe that registers a comm hook gets."""


_FIX = "the recipe contract wants an instance, a class or a zero-argument factory whose result has "\
       "backward_window(model, window) and a str name (see docs/recipe-contract.md)"


def split_recipe_path(path: str) -> tuple[str, str]:
    """``"package.module:attr"`` -> ``("package.module", "attr")``; RecipeError naming the fix otherwise."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        msg = f"recipe={path!r} must look like 'package.module:attr' (for example harness.recipes:global_token_mean)"
        raise RecipeError(msg)
    module, attr = path.split(":")
    return module, attr


def load_recipe(spec: object = None) -> Recipe:
    """The one recipe loader: ``spec`` is ``"package.module:attr"`` or the object itself (None: the correct recipe).

    The object may be an instance, a class (instantiated with no argument) or a zero-argument factory (called); the
    result must have a callable ``backward_window`` and a str ``name``, and may have an optional ``setup()`` that the
    harness calls once on every rank of each run, inside the process group, after the model is wrapped and before the
    first window, with ``model=`` (the wrapped model) and ``mesh=`` (the ranks' ``DeviceMesh``) where it takes those
    keywords; it runs under the same watch of the global random generators as each window. Every failure is a
    :class:`RecipeError` naming the path and the fix, raised before any rank starts.
    """

    if spec is None:
        from harness.recipes.correct import global_token_mean

        return global_token_mean
    where = repr(spec)
    obj: object = spec
    attr = getattr(spec, "__name__", type(spec).__name__)
    if isinstance(spec, str):
        _, attr = split_recipe_path(spec)
        obj = resolve(spec, "recipe", _FIX, RecipeError)
    # A class is built even though it has a backward_window attribute (an unbound function would crash every rank).
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "backward_window")):
        try:
            obj = obj()
        except Exception as exc:
            msg = (f"recipe={where}: calling {attr}() to build the recipe failed: {type(exc).__name__}: {exc}; "
                   f"{_FIX}")
            raise RecipeError(msg) from exc
    if not callable(getattr(obj, "backward_window", None)):
        msg = f"recipe={where}: {type(obj).__name__} has no backward_window(model, window) method; {_FIX}"
        raise RecipeError(msg)
    if not isinstance(getattr(obj, "name", None), str):
        msg = f"recipe={where}: {type(obj).__name__} needs a `name` attribute (a str) for reports; {_FIX}"
        raise RecipeError(msg)
    setup = getattr(obj, "setup", None)
    if setup is not None and not callable(setup):
        msg = (f"recipe={where}: {type(obj).__name__}.setup must be a method taking no argument (or only the "
               "keywords model and mesh), or absent")
        raise RecipeError(msg)
    return obj  # type: ignore[return-value]


def clips(recipe: object) -> bool:
    """Whether ``recipe`` clips gradients: its ``backward_window`` takes a ``max_norm`` keyword. The harness then
    passes one, and the recipe clips the synchronized gradient to it (``torch.nn.utils.clip_grad_norm_`` over every
    parameter) and returns ``(loss, total_norm)``: the loss as always (or None), and the norm before clipping."""
    return _takes(getattr(recipe, "backward_window", None), "max_norm")


def takes_mesh(recipe: object) -> bool:
    """Whether ``recipe``'s ``backward_window`` takes a ``mesh`` keyword: the harness then passes the ranks' torch
    ``DeviceMesh`` (named by ``--mesh``; ``dp=W`` without it), from which the recipe takes its groups
    (:func:`harness.recipes.helpers.token_group`). Its ``setup`` receives it too when it takes ``mesh``."""
    return _takes(getattr(recipe, "backward_window", None), "mesh")


def takes_pipeline(recipe: object) -> bool:
    """Whether ``recipe``'s ``backward_window`` takes a ``pipeline`` keyword: on a mesh with pp > 1 the harness passes
    the rank's :class:`harness.distributed.pipeline.Pipeline` (its stage, the mesh, the schedule it builds), and a
    recipe that does not take it cannot run there (:data:`NEEDS_PIPELINE`)."""
    return _takes(getattr(recipe, "backward_window", None), "pipeline")


NEEDS_PIPELINE = ("the run's mesh has pp > 1, and this recipe's backward_window takes no pipeline keyword: on a "
                  "pipeline each rank holds one stage, which a plain forward cannot run; write "
                  "backward_window(model, window, pipeline) and drive the window with pipeline.schedule(loss_fn, "
                  "n_microbatches, scale_grads=...) (harness.recipes:pipeline_token_mean; docs/recipe-contract.md)")
"""The usage error of a recipe that cannot drive a pipeline."""


def setup_takes_mesh(recipe: object) -> bool:
    """Whether ``recipe``'s ``setup`` takes a ``mesh`` keyword (see :func:`takes_mesh`)."""
    return _takes(getattr(recipe, "setup", None), "mesh")


def setup_takes_model(recipe: object) -> bool:
    """Whether ``recipe``'s ``setup`` takes a ``model`` keyword: the harness then passes the model ``backward_window``
    will receive, already wrapped by the run's strategy (DDP or FSDP2; the rank's stage on a pipeline), the object a
    library's trainer is built around (``Trainer(model=model.module, ...)``)."""
    return _takes(getattr(recipe, "setup", None), "model")


def _takes(fn: object, keyword: str) -> bool:
    import inspect

    try:
        return keyword in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def recipe_module(spec: object) -> str | None:
    """The module a ``"package.module:attr"`` recipe lives in (for the launcher to preload), else None."""
    return split_recipe_path(spec)[0] if isinstance(spec, str) else None
