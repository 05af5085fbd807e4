#!/usr/bin/env bash
# The main job: the whole r1 protocol and its report (CPU, gloo, two ranks), written to outputs/report.md.
# Installs what it needs first. `bash scripts/main.sh battery` (or any other command) runs that command instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
exec python -m harness "${@:-report}"
