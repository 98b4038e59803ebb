#!/usr/bin/env bash
# The README's second command: set up and run the test suite (CPU, tiny models).
#   bash scripts/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q "$@"
