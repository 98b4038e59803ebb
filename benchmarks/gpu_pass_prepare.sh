#!/usr/bin/env bash
# Run before the device call, in the checkout that travels (the lead's), from its root:
#   bash benchmarks/gpu_pass_prepare.sh
# 1. .gpu-site/site.tgz: the wheels the GPU image lacks, built by ../shared/tools/gpu-site.sh when missing
#    (diffusers, optimum-quanto, bitsandbytes, torchao, fastsafetensors, omegaconf + antlr4, loguru);
#    everything else the pass imports is in the image (KINDS.md's package list);
# 2. .gpu-site/commit: the commit of the tree (the copy on the device machine has no .git);
# 3. checks that the pass's files are there and that what travels stays under the 64 MiB limit.
# Then the call: carry [".gpu-site"], command `bash benchmarks/gpu_pass.sh` (docs/GPU_RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-site/site.tgz ] || bash ../shared/tools/gpu-site.sh
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
echo "commit $commit; travelling: tree $((tree / 1048576)) MiB + .gpu-site $((site / 1048576)) MiB = $total MiB (limit 64)"
[ "$total" -lt 64 ] || { echo "over the 64 MiB limit"; exit 1; }
python3 benchmarks/gpu_pass.py --list
