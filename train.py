"""Qwen-Image LoRA training.

    accelerate launch train.py --config train_configs/train_lora.yaml [key=value ...]
"""

import sys

from trainer.cli import main

FAMILY = "qwen_image"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
