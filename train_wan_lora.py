"""Wan 2.1 / 2.2 (text-to-video, one transformer) LoRA training on clips and images.

    accelerate launch train_wan_lora.py --config train_configs/train_wan_lora.yaml [key=value ...]
"""

import sys

from trainer.cli import main

FAMILY = "wan"  # the family it trains unless the YAML says otherwise
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
