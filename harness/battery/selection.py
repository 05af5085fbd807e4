"""What a battery session leaves out or narrows, decided once for every surface: ``--battery-skip CHECK[=reason]``
(a check whose verdicts are recorded as skipped, with the reason and what they would have said) and ``--quick`` (the
cases that tell the known mistakes apart, and nothing else).

Pure Python, like :mod:`harness.battery.options` which re-exports the help texts: the check names are read from the
registry (which imports torch) only when ``--battery-skip`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.battery.verdict import Verdict

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
    "no reason given"))``; each name checked against the registry (:func:`skippable`). ValueError naming the option,
    the value and the names it may take."""
    if not values:
        return ()
    texts = [values] if isinstance(values, str) else list(values)
    out: dict[str, str] = {}
    for text in texts:
        name, _, reason = str(text).partition("=")
        name = name.strip()
        valid = skippable()
        if name not in valid:
            msg = (f"{option}={text!r}: {name or 'no check'} is not a check of the battery; give one of "
                   f"{', '.join(valid)}, optionally with =reason (e.g. {option} 'empty_window=our loop skips empty "
                   "windows')")
            raise ValueError(msg)
        out[name] = reason.strip() or NO_REASON
    return tuple(out.items())


def skippable() -> tuple[str, ...]:
    """The names ``--battery-skip`` takes: every registered check, then the drawn lane's ``drawn``."""
    import harness.battery.checks  # noqa: F401  (the checks register themselves when imported)
    from harness.battery.registry import REGISTRY

    return (*REGISTRY, "drawn")


def skip(verdict: Verdict, skips: Sequence[tuple[str, str]]) -> Verdict:
    """``verdict`` recorded as skipped when its check is among ``skips`` (its status kept in ``skipped_status``, its
    message unchanged, the reason beside them); else unchanged."""
    from harness.battery.verdict import SKIPPED

    reason = dict(skips).get(verdict.check)
    if reason is None or verdict.status == SKIPPED:
        return verdict
    return replace(verdict, status=SKIPPED, skip_reason=reason, skipped_status=verdict.status)


def skip_all(verdicts: Sequence[Verdict], skips: Sequence[tuple[str, str]]) -> list[Verdict]:
    return [skip(v, skips) for v in verdicts]


def skip_message(verdict: Verdict) -> str:
    """A skipped verdict in one line: the check, the reason, and what it would have said."""
    would = {"fail": "would have FAILED", "pass": "would have passed", "n/a": "would not have applied"}
    first = verdict.message.strip().splitlines()[0] if verdict.message.strip() else ""
    return (f"check {verdict.check} skipped (--battery-skip, reason: {verdict.skip_reason}); it "
            f"{would.get(str(verdict.skipped_status), 'would have said')}: {first}")


__all__ = ["QUICK_EXAMPLES", "QUICK_HELP", "QUICK_PRECISION", "QUICK_SCENARIOS", "QUICK_WORLD_SIZES", "SKIP_HELP",
           "parse_skips", "quick_choices", "skip", "skip_all", "skip_message", "skippable"]
