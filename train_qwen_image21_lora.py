"""Qwen-Image-2.1 LoRA training (QwenImage21Pipeline: Qwen/Qwen-Image-2.1), text-to-image and with 1-3 reference
images per sample (control/ folders, as Qwen-Image-Edit).

    accelerate launch train_qwen_image21_lora.py --config train_configs/train_qwen_image21_lora_80gb.yaml [key=value ...]
"""

import sys

from trainer.cli import main

FAMILY = "qwen_image21"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
