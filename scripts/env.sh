#!/usr/bin/env bash
# Creates (once) and refreshes the project's virtual environment outside the
# clone, so that a fresh clone in CI reuses the multi-GB torch install.
# Prints the venv's path on stdout; everything else goes to stderr.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${SPIKEGUARD_CACHE:-$HOME/.cache/spikeguard}"
venv="$cache/venv"
mkdir -p "$cache"
if [ ! -x "$venv/bin/python" ]; then
  echo "spikeguard: creating $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv"
fi
# Dependencies are keyed by a hash of pyproject.toml: an unchanged file means
# nothing to install; a changed one installs only what is missing.
stamp="$venv/.pyproject.sha256"
want="$(sha256sum "$here/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "spikeguard: installing dependencies into $venv (torch is large; first time only)" >&2
  "$venv/bin/python" "$here/scripts/requirements.py" "$here/pyproject.toml" >"$cache/requirements.txt"
  "$venv/bin/python" -m pip install -q -r "$cache/requirements.txt" >&2
  echo "$want" >"$stamp"
fi
# The project itself: an editable install of *this* clone, cheap and redone
# every time, so a venv shared by several clones points at the right one.
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" >&2
echo "$venv"
