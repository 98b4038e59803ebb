"""Qwen-Image-Edit LoRA training (Qwen-Image-Edit, and Edit-2509/2511 with 1-3 references).

    accelerate launch train_qwen_edit_lora.py --config train_configs/train_lora_qwen_edit.yaml [key=value ...]
"""

import sys

from trainer.cli import main

FAMILY = "qwen_image_edit"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
