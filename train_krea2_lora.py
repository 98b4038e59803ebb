"""Krea 2 LoRA training (Krea2Pipeline: krea/Krea-2-Raw; render the LoRA on Raw or Turbo).

    accelerate launch train_krea2_lora.py --config train_configs/train_krea2_lora_80gb.yaml [key=value ...]
"""

import sys

from trainer.cli import main
from trainer.families import family_of_entry_script

FAMILY = family_of_entry_script(__file__)  # the family whose spec names this script; the YAML may say another
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
