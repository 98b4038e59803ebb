#!/usr/bin/env bash
# Create .venv (if missing) and install the requirements into it.
#   bash scripts/setup_env.sh
# Where no NVIDIA GPU is present, torch is pinned to 2.13.0 first: on this project's machines that
# is a CPU wheel on local disk. Elsewhere, set TORCH_INDEX_URL to PyTorch's CPU wheel index to avoid
# downloading the multi-GB CUDA build on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.5,<2.15"
  elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    python -m pip install -q torch==2.13.0 --index-url "$TORCH_INDEX_URL"
  else
    python -m pip install -q torch==2.13.0
  fi
fi
python -m pip install -q -r requirements.txt
python -c "import utils.quiet, torch, diffusers, transformers, peft, accelerate; print(f'torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, accelerate {accelerate.__version__}')"
