"""The command line shared by every entry script: ``--config FILE [key=value ...]``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from trainer.config import load_config
from trainer.signals import is_main_process
from utils.errors import TrainingInterrupted, UserError


def parse_args(description: str, argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Any config key can be overridden after the flags, e.g. max_train_steps=200 "
               "data_config.img_size=768",
    )
    parser.add_argument("--config", required=True, help="YAML profile in train_configs/")
    parser.add_argument("--plan", action="store_true",
                        help="print the estimated peak GPU and host memory of this config and exit (loads no weights)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="with --plan: the card's memory, e.g. 24GiB")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (dotted keys)")
    return parser.parse_args(argv)


def main(default_family: str, description: str, argv: Optional[List[str]] = None,
         profile_defaults: Optional[Dict[str, Any]] = None) -> int:
    """Load the config, train, and turn a user mistake into one clear line (exit code 2).

    ``profile_defaults`` are the entry script's own defaults (e.g. the 24 GB policy); the YAML wins.
    """
    args = parse_args(description, argv)
    if args.plan:
        return _plan(args, default_family, profile_defaults)
    from trainer.engine import Trainer  # heavy imports after argument parsing, so --help is instant

    try:
        cfg = load_config(args.config, args.overrides, default_family=default_family,
                          profile_defaults=profile_defaults)
        Trainer(cfg).run()
    except TrainingInterrupted as exc:
        if is_main_process():  # every process stops; one says so
            print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        # One clear message, no traceback: these are mistakes the user can fix.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plan(args: argparse.Namespace, family: str, profile_defaults: Optional[Dict[str, Any]]) -> int:
    from trainer.planner import load_plan_config, print_plan  # imports diffusers: only for --plan

    try:
        cfg = load_plan_config(args.config, args.overrides, family, profile_defaults)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan(cfg, args.gpu_memory)


if __name__ == "__main__":
    sys.exit(main("qwen_image", "Train a LoRA"))
