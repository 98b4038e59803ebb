"""Qwen-Image-2.1 LoRA training (QwenImage21Pipeline: Qwen/Qwen-Image-2.1), text-to-image and with 1-3 reference
images per sample (control/ folders, as Qwen-Image-Edit).

    accelerate launch train_qwen_image21_lora.py --config train_configs/train_qwen_image21_lora_80gb.yaml [key=value ...]
"""

import sys

from trainer.cli import main
from trainer.families import family_of_entry_script

FAMILY = family_of_entry_script(__file__)  # the family whose spec names this script; the YAML may say another
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
