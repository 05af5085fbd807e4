"""A recipe-level hypothesis no single window can state: each microbatch weighed by its position in its rank's window
(the first, the middle ones, the last, or a window's only one), the same in every case.

A loop written for one window shape shows it differently on each: a loop over "the first and the last microbatch"
drops the middle ones on a long window (``dropped``) and counts a one-microbatch window's only microbatch twice (a
``global_scale`` of 2 there); a loop that backpropagates the last microbatch again reads ``double_counted`` where the
window has several and a scale of 2 where it has one. Each case's weights, read per position class, give a profile
(:func:`position_profile`); the cases share the hypothesis when their profiles agree wherever they overlap
(:func:`merge`), and it names something only where the merged profile is not one scale on every class (that is a
``global_scale``). Pure: it reads the diagnosis's JSON (its ``weights``: rank, microbatch, tokens, ratio).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

POSITION = "position_weighting"
CLASSES = ("first", "middle", "last", "only")
TOLERANCE = 1e-3
"""How close two ratios of one class must be (relative to the larger of 1 and their size) to be one weight: looser than
a match (weights are read to about 1e-7 in float32), tight enough that no weighting by counts passes for a position."""


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def position_profile(weights: Sequence[Mapping[str, object]]) -> dict[str, float] | None:
    """Each position class's one ratio in a case (None when a class's ratios differ, no block holds a token, or every
    ratio is right)."""
    indices: dict[int, set[int]] = {}
    for w in weights:
        indices.setdefault(int(w["rank"]), set()).add(int(w["microbatch"]))  # type: ignore[call-overload]
    groups: dict[str, list[float]] = {}
    for w in weights:
        ratio = w.get("ratio")
        if ratio is None or not w.get("tokens"):
            continue
        mine = indices[int(w["rank"])]  # type: ignore[call-overload]
        m = int(w["microbatch"])  # type: ignore[call-overload]
        cls = "only" if len(mine) == 1 else "first" if m == min(mine) else "last" if m == max(mine) else "middle"
        groups.setdefault(cls, []).append(float(ratio))  # type: ignore[arg-type]
    if not groups:
        return None
    profile = {}
    for cls, values in groups.items():
        if any(not _close(v, values[0]) for v in values):
            return None
        profile[cls] = sum(values) / len(values)
    if all(_close(v, 1.0) for v in profile.values()):
        return None
    return profile


def merge(profiles: Iterable[Mapping[str, float] | None]) -> dict[str, float] | None:
    """One profile from several that agree on every class they share (None: one is missing, or two disagree)."""
    out: dict[str, float] = {}
    for p in profiles:
        if p is None:
            return None
        for cls, v in p.items():
            if cls in out and not _close(out[cls], v):
                return None
            out.setdefault(cls, v)
    return out or None


def names_a_position(profile: Mapping[str, float] | None) -> bool:
    """Whether the profile weighs positions differently (one weight on every class is a common scale)."""
    if not profile:
        return False
    values = list(profile.values())
    return any(not _close(v, values[0]) for v in values)


def describe(profile: Mapping[str, float]) -> str:
    words = {"first": "the window's first microbatch", "middle": "each middle one", "last": "its last",
             "only": "a window's only microbatch"}
    parts = [f"{words[c]} {round(profile[c], 4) + 0.0:g}x" for c in CLASSES if c in profile]
    return (f"each microbatch weighs by its position in its rank's window, the same in every case: {', '.join(parts)} "
            "the right weight; a loop written for one window shape (its first and last microbatch, a fixed count, "
            "the last one backpropagated again), where every microbatch must be backpropagated once, whatever the "
            "window's length")


FIX = ("backpropagate every microbatch of the window exactly once, whatever the window's length: loop over all of "
       "them, every one but the last under no_sync() (FSDP2: set_requires_gradient_sync(False)) and the last outside "
       "it; not a loop written for a first and a last microbatch or for a fixed accumulation count, and no microbatch "
       "backpropagated again")
"""The fix of a weighting by position, said where the recipe-level reading names it."""


__all__ = ["CLASSES", "FIX", "POSITION", "describe", "merge", "names_a_position", "position_profile"]
