#!/usr/bin/env bash
# What a plain `pip install` of asyncps brings (no extras): MB on disk and packages, for each git ref given
# (default: HEAD). Usage: scripts/install-size.sh [REF ...]   e.g. scripts/install-size.sh bacfd79 HEAD
set -euo pipefail
cd "$(dirname "$0")/.."
for ref in "${@:-HEAD}"; do
  work=$(mktemp -d)
  git archive "$ref" | tar -x -C "$work"
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install --quiet --disable-pip-version-check "$work" >/dev/null
  packages=$("$work/venv/bin/pip" list --disable-pip-version-check 2>/dev/null | tail -n +3 | awk '{print $1}')
  echo "$ref: $(du -sm "$work/venv" | cut -f1) MB, $(echo "$packages" | wc -l) packages: $(echo $packages)"
  rm -rf "$work"
done
