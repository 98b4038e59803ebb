#!/usr/bin/env bash
# The GPU pass in one device call (benchmarks/gpu_pass.py says what it measures and writes).
# On the device machine, from the repository root, with .gpu-site carried (benchmarks/gpu_pass_prepare.sh):
#   bash benchmarks/gpu_pass.sh                 # results in $OUT, summary table printed last
#   bash benchmarks/gpu_pass.sh --budget 300    # a shorter pass
# Here, without a GPU: bash benchmarks/gpu_pass.sh --dry-run
set -u
export GPU_PASS_T0="${GPU_PASS_T0:-$(date +%s.%N)}"  # the budget counts from here
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
PY="${PYTHON:-python3}"
# The GPU image lacks diffusers, optimum-quanto, bitsandbytes, torchao, fastsafetensors, omegaconf and
# loguru: unpack the carried wheels when they are missing.
if [ -f .gpu-site/site.tgz ] && ! "$PY" -c "import diffusers, optimum.quanto, omegaconf, loguru, bitsandbytes" 2>/dev/null; then
  SITE="${GPU_PASS_SITE:-/tmp/site}"
  mkdir -p "$SITE" && tar xzf .gpu-site/site.tgz -C "$SITE" || { echo "could not unpack .gpu-site/site.tgz"; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "unpacked .gpu-site/site.tgz into $SITE ($(date +%s.%N | awk -v t0="$GPU_PASS_T0" '{printf "%.1f", $1 - t0}') s)"
fi
exec "$PY" benchmarks/gpu_pass.py "$@"
