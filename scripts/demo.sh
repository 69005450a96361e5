#!/usr/bin/env bash
# The main job on a fresh machine: installs what it needs, then trains a small
# real model with an injected loss spike, guarded by the whole pipeline on the
# embedded bus, and shows what was detected and done.
#   scripts/demo.sh [spikeguard demo flags...]   (default: --fault spike)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$here/scripts/env.sh")"
if [ "$#" -eq 0 ]; then set -- --fault spike; fi
exec "$venv/bin/spikeguard" demo "$@"
