#!/usr/bin/env bash
# The whole CPU suite (unit, distributed, battery, slow included; GPU lanes skip with their reason).
# Installs what it needs first. Extra arguments go to pytest. Two xdist workers (the machines have 2 cores); loadgroup
# keeps the battery checks that share one launch on the worker that ran it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
exec python -m pytest -n 2 --dist loadgroup "$@"
