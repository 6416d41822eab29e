#!/usr/bin/env bash
# Installs everything the tests need and runs them (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
