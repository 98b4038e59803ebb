#!/usr/bin/env bash
# Create .venv (if missing) and install the requirements into it.
#   bash scripts/setup_env.sh
# Where no NVIDIA GPU is present, torch is pinned to 2.13.0 first: on this project's machines that
# is a CPU wheel on local disk. Elsewhere, set TORCH_INDEX_URL to PyTorch's CPU wheel index to avoid
# downloading the multi-GB CUDA build on a CPU-only machine.
# Nothing is byte-compiled at install (all of torch and transformers: about half pip's CPU time);
# scripts/warm_up.py compiles the modules a run imports, once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# uv installs: the requirements in ~8 s where pip takes ~25 s, torch from its wheel in ~4 s where pip
# takes ~12 s. The venv is made without pip (ensurepip: ~6 s); uv puts pip in afterwards.
# uv comes from the outer Python's pip (pip >= 22.3 installs into another environment), or else from
# the venv's own pip.
[ -x .venv/bin/python ] || "$PYTHON" -m venv --without-pip .venv
if [ ! -x .venv/bin/uv ]; then
  "$PYTHON" -m pip --python .venv/bin/python install -q --no-compile "uv>=0.9,<1" 2>/dev/null \
    || { .venv/bin/python -m ensurepip >/dev/null && .venv/bin/python -m pip install -q --no-compile "uv>=0.9,<1"; } \
    || { echo "setup_env: could not install uv into .venv (neither $PYTHON's pip nor ensurepip worked): install pip for $PYTHON, or uv itself, and run this again" >&2; exit 1; }
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# uv is given pip's find-links: on this project's machines the CPU torch wheel lies there.
UV=(.venv/bin/uv pip install -q)
for LINKS in ${PIP_FIND_LINKS:-}; do UV+=(--find-links "$LINKS"); done
# (Looked up, not imported: importing torch takes seconds.)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${UV[@]}" "torch>=2.5,<2.15"
  elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${UV[@]}" torch==2.13.0 --index-url "$TORCH_INDEX_URL"
  else
    "${UV[@]}" torch==2.13.0
  fi
fi
# With torch installed, the requirements' torch range is met and uv leaves it as it is. pip too, for
# the user's own `pip install` in this venv (and the tests' DeepSpeed install).
"${UV[@]}" -r requirements.txt pip
# Byte-code for the modules a run imports (scripts/warm_up.py says why). Skipped when they are
# compiled already, or when the caller runs warm_up.py itself (the quick-start, with its tiny model).
if [ -z "${SETUP_SKIP_WARM_UP:-}" ] && ! python -c "import importlib.util as u, os, sys; sys.exit(not os.path.exists(u.find_spec('peft').cached))"; then
  env -u PYTHONDONTWRITEBYTECODE python scripts/warm_up.py
fi
# The versions, read from the installed metadata (importing the libraries here would cost a run's
# worth of start-up; the next step imports them anyway, and fails clearly if one is broken).
python - <<'EOF'
from importlib.metadata import version
print(", ".join(f"{name} {version(name)}" for name in ("torch", "diffusers", "transformers", "peft", "accelerate")))
EOF
