"""FLUX.1-dev LoRA training.

    accelerate launch train_flux_lora.py --config train_configs/train_flux_config.yaml [key=value ...]
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(default_family="flux", description=__doc__))
