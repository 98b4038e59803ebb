#!/usr/bin/env bash
# Create .venv (if missing) and install the requirements into it.
#   bash scripts/setup_env.sh
# Where no NVIDIA GPU is present, torch is pinned to 2.13.0 first: on this project's machines that
# is a CPU wheel on local disk. Elsewhere, set TORCH_INDEX_URL to PyTorch's CPU wheel index to avoid
# downloading the multi-GB CUDA build on a CPU-only machine.
# --no-compile: pip would byte-compile every installed module (all of torch and transformers, about
# half the install's CPU time); Python compiles the ones a run imports, once, on first import.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
PIP=(python -m pip install -q --no-compile)
TORCH=()  # the pinned CPU torch goes in with the rest, in one resolve
# (Looked up, not imported: importing torch takes seconds.)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.5,<2.15"
  elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" torch==2.13.0 --index-url "$TORCH_INDEX_URL"
  else
    TORCH=(torch==2.13.0)
  fi
fi
"${PIP[@]}" "${TORCH[@]}" -r requirements.txt
# Byte-code: pip skipped compiling everything (--no-compile); the modules a run imports are compiled
# here, once, by importing them, also where PYTHONDONTWRITEBYTECODE is set (as on this project's CI
# machines): otherwise every process would compile torch, diffusers and peft from source again
# (import peft: 12 s from source, 5 s compiled). Skipped when they are compiled already.
if ! python -c "import importlib.util as u, os, sys; sys.exit(not os.path.exists(u.find_spec('peft').cached))"; then
  env -u PYTHONDONTWRITEBYTECODE python -c "import trainer.engine, trainer.cli, accelerate.commands.launch"
fi
# The versions, read from the installed metadata (importing the libraries here would cost a run's
# worth of start-up; the next step imports them anyway, and fails clearly if one is broken).
python - <<'EOF'
from importlib.metadata import version
print(", ".join(f"{name} {version(name)}" for name in ("torch", "diffusers", "transformers", "peft", "accelerate")))
EOF
