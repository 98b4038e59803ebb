#!/usr/bin/env bash
# The README's first command: set up, build the tiny model and sample data, train a LoRA on the
# CPU, save it, and render one image with the base model and one with the LoRA.
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=models/tiny-qwen-image
OUT=output/quickstart
PROMPT="a red circle on a yellow background"
if [ -f "$MODEL/model_index.json" ]; then
  bash scripts/setup_env.sh
else
  # One process compiles the run's modules to byte-code and builds the tiny model
  # (`python -m utils.tiny_models --family qwen_image --out DIR`): Python starts and imports the stack
  # once instead of twice (scripts/warm_up.py).
  SETUP_SKIP_WARM_UP=1 bash scripts/setup_env.sh
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python scripts/warm_up.py --family qwen_image --out "$MODEL"
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m image_datasets.sample_data --out data/sample_dataset
start=$(date +%s)
# Every launcher setting given, so accelerate has no defaults to warn about. One CPU thread: the tiny
# model's matrices are too small to share out, and on a busy machine a second thread that waits for
# its core stalls every step (60 steps took 94 s with two threads and 13 s with one, load 10 on 2 cores).
# The trainer chooses one thread for the tiny models by itself (trainer/platform.py, set_cpu_threads);
# the flag here says so to accelerate, which would otherwise warn that it set two.
# The two samples are the run's own validation renders (no second process to start and load): the
# base model's before the first step, the LoRA's after the last.
accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  --num_cpu_threads_per_process 1 train.py --config train_configs/quickstart_tiny.yaml \
  "validation.prompts=[$PROMPT]" validation.every_n_steps=60 validation.width=64 validation.height=64 \
  validation.steps=8
cp "$OUT/samples/step-000000/prompt-0.png" "$OUT/sample_base.png"
cp "$(ls -d "$OUT"/samples/step-* | tail -n 1)/prompt-0.png" "$OUT/sample_lora.png"
echo "quick-start done in $(( $(date +%s) - start )) s (training + renders): $OUT/pytorch_lora_weights.safetensors, $OUT/sample_base.png, $OUT/sample_lora.png"
echo "render again: python inference.py --model $MODEL --lora $OUT/pytorch_lora_weights.safetensors --prompt \"$PROMPT\" --width 64 --height 64 --steps 8 --base-out base.png --out lora.png"
