#!/usr/bin/env bash
# Check a machine for the CUDA 13 stack and print what to fix. Changes nothing.
#   bash scripts/setup_cuda13.sh            (PYTHON=/path/to/python to pick the interpreter)
# Checks: NVIDIA driver and GPU (nvidia-smi), the CUDA toolkit (nvcc, only needed to build
# flash-attn / FlashAttention-3), torch's CUDA version, its arch list against the GPU's sm, cuDNN,
# and the driver against torch's CUDA. Exit 1 on a hard failure (GPU training would not work),
# else 0. On a machine without an NVIDIA GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [ -n "${PYTHON:-}" ]; then :
elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
elif command -v python3 >/dev/null 2>&1; then PYTHON=python3
else PYTHON=python; fi

HARD=0
ok()   { echo "  [ok]   $*"; }
info() { echo "  [info] $*"; }
warn() { echo "  [warn] $*"; }
fail() { echo "  [FAIL] $*"; HARD=$((HARD + 1)); }
fix()  { echo "         fix: $*"; }

echo "== Host"
info "$(uname -s) $(uname -m), python: $PYTHON"

echo "== NVIDIA driver and GPU"
GPU_NAME="" DRIVER="" GPU_CC=""
if command -v nvidia-smi >/dev/null 2>&1; then
  if QUERY=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1); then
    IFS=',' read -r GPU_NAME DRIVER GPU_CC <<<"$(echo "$QUERY" | head -n 1)"
    GPU_NAME=$(echo "$GPU_NAME" | xargs) DRIVER=$(echo "$DRIVER" | xargs) GPU_CC=$(echo "$GPU_CC" | xargs)
    ok "GPU: $GPU_NAME (compute capability $GPU_CC), driver $DRIVER"
    [ "$(echo "$QUERY" | wc -l)" -gt 1 ] && info "$(echo "$QUERY" | wc -l) GPUs; checking the first"
  else
    fail "nvidia-smi is installed but fails: $QUERY"
    fix "reinstall or reload the NVIDIA driver (a reboot after a driver update is often needed)"
  fi
elif [ -e /proc/driver/nvidia/version ]; then
  warn "an NVIDIA driver is loaded but nvidia-smi is missing; install the driver's utilities"
else
  info "No NVIDIA GPU or driver on this machine: there is no CUDA to set up."
  info "The trainer runs on the CPU here (tests and the tiny models)."
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    info "$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda})")')"
  else
    info "torch is not installed for $PYTHON (bash scripts/setup_env.sh installs the CPU stack)"
  fi
  echo "Result: no CUDA on this machine (nothing to fix for CPU use)."
  exit 0
fi

echo "== CUDA toolkit (nvcc)"
if command -v nvcc >/dev/null 2>&1; then
  NVCC=$(nvcc --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p' | head -n 1)
  if [ "${NVCC%%.*}" -ge 13 ] 2>/dev/null; then ok "nvcc $NVCC"
  else
    warn "nvcc $NVCC: building flash-attn / FlashAttention-3 against a cu130 torch needs nvcc 13.x"
    fix "install CUDA toolkit 13.x (only needed for source builds; pip wheels bundle the CUDA runtime)"
  fi
else
  info "nvcc not found: not needed for pip wheels (they bundle the CUDA runtime), only to build"
  info "flash-attn or FlashAttention-3 from source"
fi

echo "== torch"
# The torch side reuses utils.device_facts (the same rules the trainer applies at start-up).
DRIVER="$DRIVER" "$PYTHON" - <<'PYEOF'
import os, sys

def out(tag, msg):
    print(f"  [{tag}] {msg}")

def fix(msg):
    print(f"         fix: {msg}")

try:
    import torch
except Exception as error:  # not installed, or a broken wheel
    out("FAIL", f"torch does not import: {error}")
    fix("pip install torch --index-url https://download.pytorch.org/whl/cu130, then pip install -r requirements.txt")
    sys.exit(1)

sys.path.insert(0, os.getcwd())
from utils.device_facts import arch_support_mode, parse_version, read_device_facts
from utils.compat import torch_install_hint

hard = 0
facts = read_device_facts()
out("info", f"torch {torch.__version__}, CUDA build {torch.version.cuda}, arch list {' '.join(facts.arch_list) or '-'}")
if torch.version.cuda is None:
    out("FAIL", "torch is a CPU-only build on a machine with an NVIDIA GPU")
    fix(f"{torch_install_hint(facts)}")
    sys.exit(1)

driver = parse_version(os.environ.get("DRIVER"))
cuda_major = parse_version(torch.version.cuda)[0]
needed = {13: 580, 12: 525, 11: 450}.get(cuda_major)
if driver and needed and driver[0] < needed:
    out("FAIL", f"driver {os.environ['DRIVER']} is too old for torch's CUDA {torch.version.cuda} (needs {needed}+)")
    fix(f"update the NVIDIA driver to {needed}+, or install a torch built for an older CUDA (cu128 / cu126)")
    hard += 1
elif driver and needed:
    out("ok  ", f"driver {os.environ['DRIVER']} supports CUDA {torch.version.cuda} (needs {needed}+)")

if not torch.cuda.is_available():
    out("FAIL", "torch.cuda.is_available() is False although nvidia-smi sees a GPU")
    fix("check CUDA_VISIBLE_DEVICES and the driver version above; run python -c 'import torch; torch.cuda.init()' for the error")
    sys.exit(1)

mode = arch_support_mode(facts=facts)
desc = f"{facts.name} ({facts.sm})"
if mode == "native":
    out("ok  ", f"torch has native kernels for {desc}")
elif mode == "compatible":
    out("ok  ", f"torch runs binary-compatible kernels on {desc} (no native {facts.sm}; torch may warn, harmless)")
elif mode == "ptx":
    out("warn", f"torch reaches {desc} only through PTX JIT (slow first start)")
    fix(f"{torch_install_hint(facts)}")
else:
    out("FAIL", f"torch has no kernels for {desc}")
    fix(f"{torch_install_hint(facts)}")
    hard += 1

cudnn = facts.cudnn_version
if cudnn is None:
    out("warn", "torch reports no cuDNN: cuDNN attention and fast convolutions are off")
    fix("reinstall torch from the cu130 index (its wheels pull nvidia-cudnn-cu13)")
elif cudnn < 90000:
    out("warn", f"cuDNN {cudnn}: cuDNN attention needs 9.0+")
else:
    out("ok  ", f"cuDNN {cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}")

if hard == 0:
    try:
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16 if facts.capability >= (8, 0) else torch.float16)
        (x @ x).sum().item()
        out("ok  ", "a matmul ran on the GPU")
    except Exception as error:
        out("FAIL", f"a matmul on the GPU failed: {error}")
        hard += 1

from utils.compat import check_requirements, get_deprecation_warnings
for message in check_requirements(facts=facts) + get_deprecation_warnings(facts):
    out("note", message)
sys.exit(1 if hard else 0)
PYEOF
[ $? -ne 0 ] && HARD=$((HARD + 1))

if [ "$HARD" -gt 0 ]; then
  echo "Result: $HARD hard failure(s): GPU training will not work until the fixes above are applied."
  exit 1
fi
echo "Result: the CUDA stack is usable (see warnings above, if any)."
