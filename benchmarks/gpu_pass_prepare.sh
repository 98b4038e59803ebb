#!/usr/bin/env bash
# Prepares a copy of this checkout for a GPU machine that has no package index (docs/GPU_RESULTS.md).
# Run it here, from the repository root, before copying the checkout (with .gpu-site/) there:
#   bash benchmarks/gpu_pass_prepare.sh
# 1. .gpu-site/site.tgz: the packages a bare GPU image may lack, packed by scripts/gpu_site.sh when
#    missing (diffusers, optimum-quanto, bitsandbytes, torchao, fastsafetensors, omegaconf + antlr4,
#    loguru); torch, transformers, accelerate, peft, safetensors and tensorboard must be there already;
# 2. .gpu-site/commit: the commit of the tree (a copy without .git still names it in the results);
# 3. checks that the pass's files are there and that the copy (tracked and untracked files not
#    ignored, plus .gpu-site/) stays under 64 MiB (GPU_PASS_MAX_MIB to change).
# Then, on the GPU machine, from the copy's root: bash benchmarks/gpu_pass.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-site/site.tgz ] || bash scripts/gpu_site.sh
listing=$(tar tzf .gpu-site/site.tgz)
for pkg in diffusers optimum/quanto bitsandbytes torchao fastsafetensors omegaconf antlr4 loguru; do
  grep -q "^\./$pkg/" <<<"$listing" || { echo "missing from .gpu-site/site.tgz: $pkg (rebuild it: rm .gpu-site/site.tgz)"; exit 1; }
done
commit="$(git rev-parse --short HEAD)"
git diff --quiet HEAD -- || commit="$commit (with uncommitted changes)"
echo "$commit" > .gpu-site/commit
for f in benchmarks/gpu_pass.sh benchmarks/gpu_pass.py benchmarks/gpu_pass_measure.py tests/gpu/test_gpu_quick.py; do
  [ -f "$f" ] || { echo "missing: $f"; exit 1; }
done
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
site=$(du -sb .gpu-site | cut -f1)
total=$(( (tree + site) / 1048576 ))
limit="${GPU_PASS_MAX_MIB:-64}"
echo "commit $commit; the copy: tree $((tree / 1048576)) MiB + .gpu-site $((site / 1048576)) MiB = $total MiB (limit $limit)"
[ "$total" -lt "$limit" ] || { echo "over the $limit MiB limit"; exit 1; }
python3 benchmarks/gpu_pass.py --list
