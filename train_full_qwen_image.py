"""Qwen-Image full fine-tuning: every transformer weight trains (or those in trainable_modules).

    accelerate launch train_full_qwen_image.py --config train_configs/train_full_qwen_image.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/fsdp.yaml train_full_qwen_image.py --config ...

The result is output_dir/final_model/, a complete pipeline folder for QwenImagePipeline.from_pretrained.
"""

import sys

from trainer.cli import main

FAMILY = "qwen_image"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS = {"training_mode": "full"}  # beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__, profile_defaults=PROFILE_DEFAULTS))
