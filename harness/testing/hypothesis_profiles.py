"""Hypothesis profiles, chosen by one environment variable (``HARNESS_HYPOTHESIS_PROFILE``).

* ``quick`` (the default): few examples, so the property tests stay in the default suite. A multi-rank example is
  one warm launch (a 2-rank DDP step: median 0.078 s, 0.068 to 0.111 s over 20 launches on a 2-core machine, in
  ``benchmarks/results/launch.json`` from ``benchmarks/launch_bench.py``), so its tests ask for
  ``max_examples(multi=True)``, a fraction of the single-process count.
* ``thorough``: for nightly runs; many more examples, still no per-example deadline.
* ``ci``: derandomized (the same examples on every run, no example database), so a red CI run can be reproduced
  locally with ``HARNESS_HYPOTHESIS_PROFILE=ci``. Chosen automatically when ``CI=true`` and the variable is unset.

Every profile has ``deadline=None``: a multi-process example costs at least a warm launch (above), more with more
ranks or steps or on a busy machine, and can trip Hypothesis's default deadline
(``hypothesis.settings.default.deadline``, 200 ms), which says nothing about the code under test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV_VAR = "HARNESS_HYPOTHESIS_PROFILE"
PROFILES = ("quick", "thorough", "ci")

# Examples per test for single-process properties, and for properties where every example launches real ranks.
_EXAMPLES = {"quick": (50, 10), "thorough": (1000, 200), "ci": (100, 20)}

_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    # too_slow: a multi-process example is slow by nature; generation itself stays cheap.
    common: dict[str, object] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("quick", max_examples=_EXAMPLES["quick"][0], **common)  # type: ignore[arg-type]
    settings.register_profile("thorough", max_examples=_EXAMPLES["thorough"][0], **common)  # type: ignore[arg-type]
    settings.register_profile(
        "ci", max_examples=_EXAMPLES["ci"][0], derandomize=True, database=None, print_blob=True,
        **common,  # type: ignore[arg-type]
    )
    _registered = True


def profile_name() -> str:
    """The profile the environment asks for: the variable, else ``ci`` under ``CI=true``, else ``quick``."""
    name = os.environ.get(ENV_VAR, "").strip()
    if not name:
        return "ci" if os.environ.get("CI", "").strip().lower() == "true" else "quick"
    if name not in PROFILES:
        msg = f"{ENV_VAR}={name!r} must be one of {PROFILES}; unset it for 'quick'"
        raise ValueError(msg)
    return name


def load_profile() -> str:
    """Register the profiles (once) and load the one the environment chooses; returns its name."""
    _register()
    name = profile_name()
    settings.load_profile(name)
    return name


def max_examples(*, multi: bool = False) -> int:
    """Examples per test under the chosen profile; ``multi=True`` for tests whose every example launches ranks."""
    single, many = _EXAMPLES[profile_name()]
    return many if multi else single


__all__ = ["ENV_VAR", "PROFILES", "load_profile", "max_examples", "profile_name"]
