#!/usr/bin/env bash
# The main job on the embedded default (CPU, gloo, two ranks). Installs what it needs first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
exec python -m harness "${@:-battery}"
