"""FLUX.2 LoRA training: [klein] base 4B / 9B (Flux2KleinPipeline) and [dev] (Flux2Pipeline).

    accelerate launch train_flux2_lora.py --config train_configs/train_flux2_klein_lora.yaml [key=value ...]
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(default_family="flux2", description=__doc__))
