#!/usr/bin/env bash
# The integrations lane: the library recipes (harness/recipes/libraries/) against the real transformers, accelerate
# and torchtitan. Installs them first (once; a later run that finds them installed skips the install), then runs
# `pytest -m integrations` on tests/integrations. Extra arguments go to pytest.
#
# Every install is constrained to the torch already in the environment (the CPU wheel setup-env.sh installs), so no
# library can replace it with another build; the script checks afterwards that torch is the one it started with.
# torchtitan is installed with --no-deps plus the two packages it imports at run time (spmd_types, tyro): its full
# dependency list (about 45 packages: datasets, tokenizers, tensorboard, ...) is not needed for its loss. It is pinned to
# the version the lane tested (harness.recipes.libraries.TESTED_WITH), as the extra's bounds are.
#
# The lane records the versions it ran: pytest's header prints them, and outputs/integrations-junit.xml holds each as a
# test-suite property (HARNESS_INTEGRATIONS_JUNIT names another file).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
venv="${HARNESS_VENV:-$root/.venv}"
stamp="$venv/.integrations-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "${BASH_SOURCE[0]}" -nt "$stamp" ]; then
  torch_before="$(python -c 'import torch; print(torch.__version__)')"
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  echo "torch==${torch_before%%+*}" >"$constraints"
  echo "installing the integrations extra into $venv (torch held at $torch_before)" >&2
  python -m pip install -q -c "$constraints" -e "$root[integrations]"
  python -m pip install -q -c "$constraints" --no-deps "torchtitan==0.3.0"
  python -m pip install -q -c "$constraints" "spmd_types==0.2.3" "tyro>=1,<2"
  torch_after="$(python -c 'import torch; print(torch.__version__)')"
  if [ "$torch_after" != "$torch_before" ]; then
    echo "integrations install replaced torch $torch_before with $torch_after; reinstall it (scripts/setup-env.sh)" >&2
    exit 1
  fi
  touch "$stamp"
fi
# One worker: every test launches two ranks, which fill the two cores; two xdist workers measured twice as slow here
# (49 tests: 90 s with -n 2 --dist loadgroup, 45 s with -n 0, on the same loaded machine). "-n 2" after it overrides.
junit="${HARNESS_INTEGRATIONS_JUNIT:-$root/outputs/integrations-junit.xml}"
mkdir -p "$(dirname "$junit")"
exec python -m pytest -m integrations -n 0 --junitxml "$junit" tests/integrations "$@"
