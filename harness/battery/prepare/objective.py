"""The declared objective inside a battery run: resolved once per recipe in the parent, it gives the windows their
drawn factors, the reference its formula, the logged-loss check its truth (the formula is
:mod:`harness.core.objectives`; the diagnosis's readings of it are :mod:`harness.diagnosis.objective`).

What a recipe declares beside ``backward_window`` (docs/recipe-contract.md, "Objectives and auxiliary terms"):

- ``normalizer`` (a positive number): under ``--objective=fixed_normalizer``, the constant its loss sum is divided by;
- ``token_weights = "advantages"``: its per-token loss carries the factor ``Microbatch.weights``, signed advantages the
  harness draws (a policy-gradient loss); under ``weighted_token_mean`` the harness draws non-negative weights anyway;
- ``label_smoothing`` (``--objective=label_smoothing``) or ``entropy_coefficient`` (``--objective=entropy_bonus``, whose
  advantages the harness draws whatever the recipe declares): the per-token loss's coefficient, in [0, 1);
- ``auxiliary_unit`` (``"microbatch"``, ``"token"``, ``"sequence"`` or ``"global"``) with ``auxiliary_loss(model, batch,
  logits)``: the auxiliary term of one microbatch, computed from the logits of its forward (or, under ``"global"``, its
  router statistics, :mod:`harness.core.router_terms`), that the reference adds with its unit's normalization.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from harness.battery.plan.options import RunSpec
from harness.battery.spec import ModelSpec
from harness.core import objectives as ob
from harness.core.microbatch import Microbatch
from harness.core.router_terms import DeclarationError, bind
from harness.diagnosis.evidence import terms as objective_terms

Auxiliary = Callable[[nn.Module, object, torch.Tensor], object]


@functools.lru_cache(maxsize=64)
def _loaded(recipe: str) -> object | None:
    from harness.recipes import RecipeError, load_recipe

    try:
        return load_recipe(recipe)
    except RecipeError:
        return None  # the ranks report a recipe that cannot load, as they always did


@functools.lru_cache(maxsize=128)
def resolve(name: str, recipe: str) -> ob.Objective:
    """Objective ``name`` as ``recipe`` (``"pkg.mod:attr"``) declares its parts; ValueError naming the attribute and
    the fix when a declaration is missing or wrong."""
    ob.check_objective(name)
    obj = _loaded(recipe)
    normalizer = getattr(obj, "normalizer", None)
    if name != ob.FIXED_NORMALIZER and not (isinstance(normalizer, (int, float)) and normalizer > 0):
        normalizer = None  # kept under another objective only as what the diagnosis may name
    if name == ob.FIXED_NORMALIZER and normalizer is None:
        msg = (f"recipe={recipe!r} declares no `normalizer`: under --objective=fixed_normalizer a recipe declares the "
               "constant its loss sum is divided by, as an attribute (normalizer = 1024.0, e.g. batch size x maximum "
               "completion length)")
        raise ValueError(msg)
    declared = getattr(obj, "token_weights", None)
    weights = ob.WEIGHTS if name == ob.WEIGHTED_TOKEN_MEAN and declared is None else declared
    coefficient = _coefficient(name, obj, recipe)
    if name == ob.ENTROPY_BONUS:
        weights = ob.ADVANTAGES  # its policy loss weighs each log-prob by a drawn advantage
    unit = getattr(obj, "auxiliary_unit", None)
    if unit is not None and not callable(getattr(obj, "auxiliary_loss", None)):
        msg = (f"recipe={recipe!r} declares auxiliary_unit={unit!r} but no auxiliary_loss(model, batch, logits) "
               "method: the reference computes the term through it")
        raise ValueError(msg)
    return ob.Objective(name, normalizer, weights, unit, recipe if unit is not None else None, coefficient)


def _coefficient(name: str, obj: object, recipe: str) -> float | None:
    """The per-token loss's coefficient the recipe declares under ``name`` (None under an objective without one);
    ValueError naming the attribute, the value and the fix when it is missing or out of range."""
    attribute = ob.TOKEN_LOSS_COEFFICIENTS.get(name)
    if attribute is None:
        return None
    value = getattr(obj, attribute, None)
    example = {"label_smoothing": "label_smoothing = 0.1", "entropy_coefficient": "entropy_coefficient = 0.01"}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        said = f"no `{attribute}`" if value is None else f"{attribute}={value!r}"
        msg = (f"recipe={recipe!r} declares {said}: under --objective={name} a recipe declares its "
               f"coefficient, a number in [0, 1), as an attribute ({example[attribute]}; docs/objectives.md)")
        raise ValueError(msg)
    return float(value)


class AuxiliaryError(RuntimeError):
    """The recipe's own ``auxiliary_loss`` raised while the reference computed its term: the recipe's error, never
    the model's limit (a run whose every case then reads n/a would say "every check holds")."""


def auxiliary_of(objective: ob.Objective) -> Auxiliary | None:
    """The parent's ``auxiliary_loss`` of the objective's recipe (None: no auxiliary term); an exception it raises
    comes out as :class:`AuxiliaryError` naming the recipe."""
    if objective.auxiliary_recipe is None:
        return None
    own = getattr(_loaded(objective.auxiliary_recipe), "auxiliary_loss", None)
    if own is None:
        return None

    def called(model: nn.Module, batch: Any, logits: torch.Tensor) -> Any:
        try:
            return own(model, batch, logits)
        except DeclarationError:
            raise
        except Exception as exc:
            msg = (f"recipe={objective.auxiliary_recipe!r}: its auxiliary_loss(model, batch, logits) raised "
                   f"{type(exc).__name__}: {str(exc).strip()} (called on the single-device reference model with a "
                   f"{type(batch).__name__} batch and logits {tuple(logits.shape)}, as on the ranks); fix the "
                   "recipe's auxiliary_loss")
            raise AuxiliaryError(msg) from exc

    return called


def with_factors(windows: Sequence[Sequence[Sequence[Microbatch]]],
                 objective: ob.Objective) -> list[list[list[Microbatch]]]:
    """The windows with the factors the objective needs drawn (unchanged lists when it needs none)."""
    if objective.weights is None:
        return [[list(rank) for rank in window] for window in windows]
    return ob.with_factors(windows, objective.weights)


def windows_for(run: RunSpec, windows: Sequence[Sequence[Sequence[Microbatch]]]) -> list[list[list[Microbatch]]]:
    """``windows`` as ``run`` judges them: with the factors its objective needs (the same draw in every process)."""
    objective = resolve(run.objective, run.recipe)
    if objective.weights is None:
        return windows  # type: ignore[return-value]
    return with_factors(windows, objective)


def terms(spec: ModelSpec, objective: ob.Objective, model: nn.Module,
          mb: Microbatch) -> tuple[torch.Tensor, object]:
    """One microbatch's term of the objective's numerator and its auxiliary value (None without one), from one
    forward of ``model`` under the run's batch convention (:func:`harness.diagnosis.evidence.terms`, with the
    recipe's own ``auxiliary_loss``). The plain token mean is the loss sum itself."""
    return objective_terms(spec, objective, auxiliary_of(objective), model, mb)


def value_at(spec: ModelSpec, objective: ob.Objective, model: nn.Module,
             windows: Sequence[Sequence[Microbatch]]) -> float:
    """The objective's value (its auxiliary term included) over one global window, without gradients."""
    z = objective.window_normalizer(windows)
    d = objective.auxiliary_denominator(windows) if objective.auxiliary_unit else 1.0
    finish = bind(objective.auxiliary_unit, lambda mb: terms(spec, objective, model, mb)[1],
                  [mb for rank in windows for mb in rank])
    total = 0.0
    with torch.no_grad():
        for rank in windows:
            for mb in rank:
                term, value = terms(spec, objective, model, mb)
                aux = finish(value)
                total += float(term) / z + (0.0 if aux is None else float(aux) / d)
    return total


__all__ = ["Auxiliary", "AuxiliaryError", "auxiliary_of", "resolve", "terms", "value_at", "windows_for", "with_factors"]
