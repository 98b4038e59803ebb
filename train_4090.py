"""Qwen-Image LoRA on a 24 GB or 16 GB card (RTX 4090/3090, 4080): the shared engine with a low-memory policy.

    accelerate launch train_4090.py --config train_configs/train_lora_4090.yaml [key=value ...]
    accelerate launch train_4090.py --config train_configs/train_lora_16gb.yaml

Both profiles set auto_fit: true with their card's gpu_memory: before anything loads, the memory planner
picks the fastest quantization, gradient checkpointing, checkpoint offload, optimizer and block swap that
fit the card (docs/MEMORY_PLANNER.md), and the defaults below give way to its choice; its 8-bit weights are
torchao ``auto``: multiplied in fp8 (sm_89+) or int8 (sm_80/86), the fastest the GPU's one-time check finds
right (docs/LOW_MEMORY.md). Where auto_fit is off (train_dgx_spark.yaml) or has nothing to fit, the defaults
apply beneath the YAML: the transformer quantized block by block (qfloat8 unless the YAML's quantization
section says otherwise), 8-bit AdamW, caches on disk (text encoder and VAE freed before the transformer
loads), the kept block inputs of gradient checkpointing in host memory.
"""

import sys

from trainer.cli import main

LOW_MEMORY = {"quantize": True, "adam8bit": True, "precompute_text_embeddings": True,
              "precompute_image_embeddings": True, "save_cache_on_disk": True,
              "gradient_checkpointing_cpu_offload": True}

FAMILY = "qwen_image"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS = LOW_MEMORY  # beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__, profile_defaults=PROFILE_DEFAULTS))
