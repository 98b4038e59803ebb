"""Compile the modules a training run imports to byte-code, once, by importing them.

    env -u PYTHONDONTWRITEBYTECODE python scripts/warm_up.py                  # what setup_env.sh runs
    env -u PYTHONDONTWRITEBYTECODE python scripts/warm_up.py --family qwen_image --out DIR

pip and uv install without byte-code (compiling all of torch and transformers would double the
install's time), and where PYTHONDONTWRITEBYTECODE is set (this project's CI machines) every process
would compile torch, diffusers and peft from source again: `import peft` takes 12 s from source, 5 s
compiled. With arguments, the tiny-model builder (`python -m utils.tiny_models ARGS`) runs in this same
process afterwards: the quick-start then starts Python and imports the stack once instead of twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from anywhere

import accelerate.commands.launch  # noqa: F401  (what `accelerate launch` imports)

import trainer.cli
import trainer.engine  # noqa: F401

if __name__ == "__main__" and len(sys.argv) > 1:
    from utils.tiny_models.__main__ import main

    sys.exit(main(sys.argv[1:]))
