"""Qwen-Image-Edit LoRA training (Qwen-Image-Edit, and Edit-2509/2511 with 1-3 references).

    accelerate launch train_qwen_edit_lora.py --config train_configs/train_lora_qwen_edit.yaml [key=value ...]
"""

import sys

from trainer.cli import main
from trainer.families import family_of_entry_script

FAMILY = family_of_entry_script(__file__)  # the family whose spec names this script; the YAML may say another
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
