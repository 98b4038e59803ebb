"""Qwen-Image LoRA training.

    accelerate launch train.py --config train_configs/train_lora.yaml [key=value ...]
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(default_family="qwen_image", description=__doc__))
