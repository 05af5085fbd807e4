#!/usr/bin/env bash
# The CPU suite: unit, distributed and battery tests; GPU lanes skip with their reason. Without a -m of its own, the
# `slow` tier (end-to-end subprocess runs of over ~10 s each) is left out: `bash scripts/test.sh -m slow` runs it, and
# CI runs both (.ci/run). Installs what it needs first. Extra arguments go to pytest. Two xdist workers (the machines
# have 2 cores); loadgroup keeps the battery checks that share one launch on the worker that ran it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
select=(-m "not slow")
for arg in "$@"; do
  case "$arg" in
    -m|-m*) select=() ;;
  esac
done
exec python -m pytest -n 2 --dist loadgroup "${select[@]}" "$@"
