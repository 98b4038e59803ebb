#!/usr/bin/env bash
# The README's first command: set up, build the tiny model and sample data, train a LoRA on the
# CPU, save it, and render one image with the base model and one with the LoRA.
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
MODEL=models/tiny-qwen-image
OUT=output/quickstart
[ -f "$MODEL/model_index.json" ] || python -m utils.tiny_models --family qwen_image --out "$MODEL"
python -m image_datasets.sample_data --out data/sample_dataset
# Every launcher setting given, so accelerate has no defaults to warn about (the CPU threads are its own
# default: one per physical core).
THREADS=$(python -c "import psutil; print(psutil.cpu_count(logical=False) or 1)")
start=$(date +%s)
accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  --num_cpu_threads_per_process "$THREADS" train.py --config train_configs/quickstart_tiny.yaml
# Both samples in one process (one start-up, one model load): the base model's, then with the LoRA.
python inference.py --model "$MODEL" --lora "$OUT/pytorch_lora_weights.safetensors" \
  --prompt "a red circle on a yellow background" --width 64 --height 64 --steps 8 \
  --base-out "$OUT/sample_base.png" --out "$OUT/sample_lora.png"
echo "quick-start done in $(( $(date +%s) - start )) s (training + renders): $OUT/pytorch_lora_weights.safetensors, $OUT/sample_base.png, $OUT/sample_lora.png"
