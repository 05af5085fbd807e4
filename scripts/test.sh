#!/usr/bin/env bash
# The whole CPU suite (unit, distributed, battery, slow included; GPU lanes skip with their reason).
# Installs what it needs first. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
exec python -m pytest "$@"
