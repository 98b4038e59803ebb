"""Krea 2 LoRA training (Krea2Pipeline: krea/Krea-2-Raw; render the LoRA on Raw or Turbo).

    accelerate launch train_krea2_lora.py --config train_configs/train_krea2_lora_80gb.yaml [key=value ...]
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(default_family="krea2", description=__doc__))
