#!/usr/bin/env bash
# Packs the Python packages a bare GPU image may lack (diffusers, optimum-quanto, bitsandbytes, torchao,
# fastsafetensors, omegaconf + antlr4, loguru) into .gpu-site/site.tgz in the repository root (about
# 15 MB; .gpu-site/ is git-ignored), so that a copy of the checkout can take them to a GPU machine
# with no package index. Run from the repository root, on any machine with pip and network access:
#   bash scripts/gpu_site.sh
# benchmarks/gpu_pass_prepare.sh runs it when the file is missing, and benchmarks/gpu_pass.sh unpacks
# it on the GPU machine when those packages are not installed there. By hand:
#   mkdir -p /tmp/site && tar xzf .gpu-site/site.tgz -C /tmp/site && export PYTHONPATH=/tmp/site
# The GPU machine must already have torch (a CUDA build), transformers, accelerate, peft, safetensors
# and tensorboard. The wheels are for CPython GPU_SITE_PYTHON (default 3.12) on x86_64 Linux, with
# bitsandbytes' CUDA 13.0 library: set GPU_SITE_PYTHON to the GPU machine's Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpu-site
PYVER="${GPU_SITE_PYTHON:-3.12}"
mkdir -p "$D/w"
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64"
P="$P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp $P \
  -d "$D/w" diffusers==0.42.1 optimum-quanto==0.2.7 fastsafetensors==0.5.0 omegaconf==2.3.0 \
  loguru==0.7.3 bitsandbytes==0.50.2 torchao==0.17.0
python3 -m pip download -q --no-deps --no-binary=:all: -d "$D/w" antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps -w "$D/w" "$D"/w/antlr4-python3-runtime-4.9.3.tar.gz
rm -rf "$D/site"; mkdir -p "$D/site"
for w in "$D"/w/*.whl; do python3 -m zipfile -e "$w" "$D/site"; done
# bitsandbytes ships a library per CUDA/ROCm version; keep the CUDA 13.0 one (and the CPU one).
find "$D/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*cuda130*' ! -name '*cpu*' -delete
tar czf "$D/site.tgz" -C "$D/site" . && rm -rf "$D/site" "$D/w"
ls -la "$D/site.tgz"
