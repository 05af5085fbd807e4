"""What a battery session leaves out or narrows, decided once for every surface: ``--battery-skip CHECK[=reason]``
(a check whose verdicts are recorded as skipped, with the reason and what they would have said) and ``--quick`` (the
cases that tell the known mistakes apart, and nothing else).

Pure Python and importing nothing of the harness, like :mod:`harness.battery.plan.options` which re-exports the help
texts: recording a verdict as skipped and checking the names against the registry is
:mod:`harness.battery.plan.skips`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

SKIP_HELP = ("record CHECK's verdicts as skipped instead of failing the battery (repeatable; CHECK is a check of the "
             "registry or drawn, e.g. --battery-skip 'empty_window=our loop skips empty windows'): the check still "
             "runs, and the summary lists it with the reason and what it would have said; exit 0 when only skipped "
             "checks failed")
"""``--battery-skip``'s help, the same on every surface."""

QUICK_HELP = ("run only the cases that tell the known mistakes apart (W=2 and 3, fp32, the uneven, single and "
              "one_empty scenarios, the two drawn layouts chosen for it): seconds, not a minute; then run the full "
              "battery. --battery-world-sizes, --precision or --battery-examples given with another value than "
              "their default win over --quick's")
"""``--quick``'s help, the same on every surface."""

QUICK_WORLD_SIZES = (2, 3)
"""``--quick``'s world sizes: 2 is the smallest where ranks can disagree, 3 the first where two ranks' counts can
differ from a third's (a mean of local means and a per-microbatch mean read apart there)."""
QUICK_PRECISION = "fp32"
QUICK_SCENARIOS = ("uneven", "single", "one_empty")
"""Unequal counts per rank and per microbatch (uneven), one microbatch per window (single: a missing ``no_sync`` or a
per-microbatch mean reads apart from a mean of local means) and a rank without any token (one_empty)."""
QUICK_EXAMPLES = 2
"""The drawn lane's two chosen layouts (:func:`harness.battery.layouts.informative_layouts`), no random one."""

NO_REASON = "no reason given"

DEFAULTS = {"world_sizes": "1,2,3,4", "precision": "both", "examples": 12}
"""The options ``--quick`` narrows, at the defaults every surface declares: another value was chosen, and wins."""


def quick_choices(world_sizes: object, precision: str, examples: object) -> tuple[object, str, object]:
    """``--quick``'s world sizes, precision and drawn examples, except where the option says otherwise than its
    default (an explicit ``--battery-world-sizes 4`` runs the quick scenarios at W=4)."""
    given = {"world_sizes": world_sizes, "precision": precision, "examples": examples}
    plain = {k: _is_default(k, v) for k, v in given.items()}
    return (QUICK_WORLD_SIZES if plain["world_sizes"] else world_sizes,
            QUICK_PRECISION if plain["precision"] else precision,
            QUICK_EXAMPLES if plain["examples"] else examples)


def _is_default(name: str, value: object) -> bool:
    if name == "world_sizes" and not isinstance(value, str) and value is not None:
        value = ",".join(map(str, value))  # type: ignore[call-overload]
    return value is None or value == DEFAULTS[name] or str(value) == str(DEFAULTS[name])


def parse_skips(values: str | Sequence[str] | None, option: str = "--battery-skip") -> tuple[tuple[str, str], ...]:
    """``["empty_window=our loop skips them", "hygiene"]`` -> ``(("empty_window", "our loop skips them"), ("hygiene",
    "no reason given"))``: the syntax only; each surface checks the names against the registry
    (:func:`harness.battery.plan.skips.check_skips`), which this pure-Python module does not import."""
    if not values:
        return ()
    texts = [values] if isinstance(values, str) else list(values)
    out: dict[str, str] = {}
    for text in texts:
        name, _, reason = str(text).partition("=")
        out[name.strip()] = reason.strip() or NO_REASON
    return tuple(out.items())


__all__ = ["NO_REASON", "QUICK_EXAMPLES", "QUICK_HELP", "QUICK_PRECISION", "QUICK_SCENARIOS", "QUICK_WORLD_SIZES",
           "SKIP_HELP", "parse_skips", "quick_choices"]
