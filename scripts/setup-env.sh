#!/usr/bin/env bash
# Create .venv (once) and install the harness with its test tools into it. Sourced by the other scripts.
# TORCH_SPEC picks the torch build: the default pins the CPU wheel CI uses; pyproject.toml itself asks only torch>=2.4.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HARNESS_VENV:-$root/.venv}"
stamp="$venv/.installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "installing into $venv (torch first: ${TORCH_SPEC:-torch==2.13.0})" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  "$venv/bin/python" -m pip install -q -e "$root[test,dev]"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
