"""``python -m trainer.planner --config X.yaml [--gpu-memory 24GiB] [key=value ...]``: print a memory plan."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import trainer.planner
from utils.errors import UserError
from trainer.families import SPECS
from trainer.planner.entry import print_plan
from trainer.planner.settings import load_plan_config


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the arguments, load the config without needing its data, print the plan; the exit code
    says whether it fits (0), does not (1), or could not be made (2)."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.planner", description=trainer.planner.__doc__.split("\n\n")[0],
        epilog="Config keys can be overridden after the flags, e.g. data_config.img_size=768")
    parser.add_argument("--config", required=True, help="YAML profile in train_configs/")
    parser.add_argument("--gpu-memory", help="the card's memory, e.g. 24GiB, 16GiB, 80GB (a bare number is GiB; "
                                             "default: the config's gpu_memory)")
    parser.add_argument("--family", default="qwen_image", choices=list(SPECS),
                        help="family when the YAML names none (default: train.py's, qwen_image)")
    parser.add_argument("--blocks-to-swap", type=int, help="override blocks_to_swap")
    parser.add_argument("--quantization", help="override the transformer quantization (qfloat8, qint4, none, ...)")
    parser.add_argument("--text-tokens", type=int,
                        help="caption tokens per sample (default: the family's; 128 for the Qwen models)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan a GPU run or a CPU run")
    parser.add_argument("--whole-model-loading", action="store_true",
                        help="plan the from_pretrained fallback (whole transformer on the host) instead of "
                             "the streamed loader (one shard at a time)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (fits, gpu_peak_gib, host_peak_gib, settings, items, auto_fit)")
    parser.add_argument("--pipeline-stages", type=int, default=1, metavar="N",
                        help="plan the blocks split over N cards (pipeline stages): each card's peak and the "
                             "traffic per step against FSDP and block swap (docs/TWO_CARDS.md)")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="the launch's processes (cards): auto_fit may then choose pipeline stages, one a card")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_plan_config(args.config, args.overrides, args.family)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan(cfg, args.gpu_memory, blocks_to_swap=args.blocks_to_swap, quantization=args.quantization,
                      text_tokens=args.text_tokens, device=args.device,
                      streamed_loading=not args.whole_model_loading, as_json=args.json,
                      pipeline_stages=args.pipeline_stages, processes=args.processes)


if __name__ == "__main__":
    sys.exit(main())
