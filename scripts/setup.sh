#!/usr/bin/env bash
# Installs nemo-duplex into .venv on a fresh machine: torch 2.13.0 first (the CPU build on this
# machine's disk; a bare `torch` would pull a multi-GB CUDA build), then the package.
# Usage: bash scripts/setup.sh [dev]   ("dev" adds the test tools and the system packages tests use)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "dev" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # espeak-ng/sox: test clips; chromium: the browser-page test
  apt-get update -qq >/dev/null && apt-get install -y -qq espeak-ng sox chromium >/dev/null
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
if [ "${1:-}" = "dev" ]; then python -m pip install -q -e '.[dev]'; else python -m pip install -q -e .; fi
