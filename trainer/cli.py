"""The command line shared by every entry script: ``--config FILE [key=value ...]``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional

from trainer.config import load_config
from trainer.signals import is_main_process
from utils.errors import LaunchError, TrainingInterrupted, UserError


def parse_args(description: str, argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Any config key can be overridden after the flags, e.g. max_train_steps=200 "
               "data_config.img_size=768",
    )
    parser.add_argument("--config", required=True, help="YAML profile in train_configs/")
    parser.add_argument("--plan", action="store_true",
                        help="print the estimated peak GPU and host memory of this config and exit (loads no weights)")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="the card's memory, e.g. 24GiB: with --plan, the plan's budget; in a run, what "
                             "auto_fit fits (the same as gpu_memory=SIZE)")
    parser.add_argument("--json", action="store_true", help="with --plan: print the plan as one JSON object")
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
    if args.gpu_memory:  # the budget auto_fit fits, as the key would give it
        args.overrides.append(f"gpu_memory={args.gpu_memory}")
    from trainer.engine import Trainer  # heavy imports after argument parsing, so --help is instant

    try:
        cfg = load_config(args.config, args.overrides, default_family=default_family,
                          profile_defaults=profile_defaults)
        Trainer(cfg).run()
    except TrainingInterrupted as exc:
        if is_main_process():  # every process stops; one says so
            print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except LaunchError as exc:
        return say_once_per_machine(exc)
    except UserError as exc:
        # One clear message, no traceback: these are mistakes the user can fix.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


# How long the other processes of a launch wait for the first one to say a launch error. torchrun
# stops every process once one has exited, and the first to exit must be the one that says it.
LAUNCH_ERROR_WAIT_S = 60.0


def say_once_per_machine(exc: LaunchError) -> int:
    """Every process of the launch met ``exc``: local rank 0 says it (one line per machine, not one per
    process) and exits with 2; the others exit with 2 too, silently, once the launcher stops them (it
    does when the first process exits) or after ``LAUNCH_ERROR_WAIT_S``."""
    if first_on_machine():
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(2))
    time.sleep(LAUNCH_ERROR_WAIT_S)
    return 2


def first_on_machine() -> bool:
    """Local rank 0 of a launch (``LOCAL_RANK``, else ``RANK``, as torchrun sets them), or a lone process."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0


def _plan(args: argparse.Namespace, family: str, profile_defaults: Optional[Dict[str, Any]]) -> int:
    from trainer.planner import load_plan_config, print_plan  # imports diffusers: only for --plan

    try:
        cfg = load_plan_config(args.config, args.overrides, family, profile_defaults)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan(cfg, args.gpu_memory, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main("qwen_image", "Train a LoRA"))
