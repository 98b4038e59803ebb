#!/usr/bin/env bash
# The README's second command: set up and run the test suite (CPU, tiny models).
#   bash scripts/run_tests.sh [pytest args]
# Two pytest workers by default (PYTEST_WORKERS=N to change; 0 runs in this process). The end-to-end tests'
# `python ...` commands fork from one warmed-up interpreter per worker instead of importing torch, diffusers
# and peft each time (tests/zygote.py; ZYGOTE=0 starts every one fresh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Test-only extras (DeepSpeed for tests/test_sharded.py: an sdist whose setup imports torch, ~10 s).
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation -r requirements-test.txt
bash scripts/setup_browser.sh  # the web page's browser test skips, saying why, where it cannot install
# shellcheck disable=SC1091
. .venv/bin/activate
# The suite starts hundreds of Python processes: let the first that imports a module write its byte-code
# for the others (where PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines, each compiled
# matplotlib, deepspeed and the tests' modules from source again: ~2 CPU s per training run).
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
