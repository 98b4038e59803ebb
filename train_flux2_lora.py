"""FLUX.2 LoRA training: [klein] base 4B / 9B (Flux2KleinPipeline) and [dev] (Flux2Pipeline).

    accelerate launch train_flux2_lora.py --config train_configs/train_flux2_klein_lora.yaml [key=value ...]
"""

import sys

from trainer.cli import main
from trainer.families import family_of_entry_script

FAMILY = family_of_entry_script(__file__)  # the family whose spec names this script; the YAML may say another
PROFILE_DEFAULTS: dict = {}  # nothing beneath the YAML

if __name__ == "__main__":
    sys.exit(main(default_family=FAMILY, description=__doc__))
