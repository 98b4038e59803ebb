"""Caption a folder of images with a vision-language model: ``<image>.txt`` beside each image.

    python caption.py --data DIR [--model PATH_OR_ID] [--prompt TEXT] [--trigger-word WORD]
                      [--max-new-tokens N] [--batch-size N] [--overwrite | --skip-existing]
                      [--quantize 4bit|8bit] [--dtype auto|bf16|fp16|fp32] [--caption-ext txt]
                      [--dry-run] [--json]
    python caption.py --config train_configs/train_lora.yaml [...]   # each dataset of a training profile

Existing captions are kept (``--skip-existing``, the default) unless ``--overwrite``; an interrupted
run picks up where it stopped when run again. The default model is a small Qwen-VL
(Qwen/Qwen3-VL-2B-Instruct); any model that transformers' AutoModelForImageTextToText loads works.
``--json`` prints one JSON line per image and a last one with the summary (for programs).

Exit code: 0 when every image has a caption, 1 when some failed (each named with its reason), 2 for
a usage mistake or a folder that cannot take captions (read-only, no permission: said before the model
loads; a full disk: the captions written so far are kept).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import utils.quiet  # noqa: F401  (first: silences known-harmless messages of transformers' imports)
from image_datasets.captioning import (DEFAULT_MODEL, DEFAULT_PROMPT, DTYPES, QUANTIZATIONS, CaptionOptions,
                                       CaptionReport, CaptionWriteError, Captioner, Plan, caption_folder,
                                       check_writable, plan_folder)
from utils.errors import UserError


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--data", help="folder of images (sub-folders included)")
    where.add_argument("--config", help="training profile: caption each of its datasets (its caption_type and "
                                        "trigger_word apply)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"hub id or local folder (default {DEFAULT_MODEL})")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="what to ask about each image")
    parser.add_argument("--trigger-word", help="put first in every caption (default: the dataset's with --config)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest caption in tokens (default 256)")
    parser.add_argument("--batch-size", type=int, default=1, help="images per generation (default 1)")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--overwrite", action="store_true", help="replace existing captions")
    existing.add_argument("--skip-existing", action="store_true", help="keep existing captions (the default)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, help="load the model in 4 or 8 bits (bitsandbytes, GPU)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16/fp16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when there is a GPU)")
    parser.add_argument("--max-image-side", type=int, default=1024, help="scale larger images down first")
    parser.add_argument("--revision", help="hub revision of --model")
    parser.add_argument("--caption-ext", default="txt",
                        help="caption file extension with --data (default txt; --config: each dataset's caption_type)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be captioned; load no model")
    parser.add_argument("--json", action="store_true", help="one JSON line per image, then the summary")
    return parser.parse_args(argv)


def jobs(args: argparse.Namespace) -> List[Tuple[Path, CaptionOptions]]:
    """Each folder to caption with its options: ``--data``, or every dataset of ``--config`` (its
    caption extension and trigger word; ``--trigger-word`` wins)."""
    common = dict(model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                  batch_size=args.batch_size, overwrite=args.overwrite, quantization=args.quantize,
                  dtype=args.dtype, device=args.device, max_image_side=args.max_image_side, revision=args.revision)
    if args.data:
        return [(Path(args.data), CaptionOptions(**common, caption_ext=args.caption_ext,
                                                 trigger_word=args.trigger_word))]
    from trainer.config import dataset_entries, load_config

    cfg = load_config(args.config)
    return [(Path(entry.img_dir), CaptionOptions(**common, caption_ext=entry.caption_type,
                                                 trigger_word=args.trigger_word or entry.trigger_word))
            for entry in dataset_entries(cfg)]


def dry_run(work: List[Tuple[Path, CaptionOptions]], plans: List[Plan]) -> int:
    for (folder, options), plan in zip(work, plans):
        print(f"{folder}: would caption {len(plan.todo)}, skip {len(plan.skipped)} (caption exists) "
              f"with {options.model}")
        for image in plan.todo[:10]:
            print(f"  {image}")
        if len(plan.todo) > 10:
            print(f"  ... and {len(plan.todo) - 10} more")
        for image, reason in plan.failed:
            print(f"  cannot caption {image}: {reason}")
    return 0


def caption_all(work: List[Tuple[Path, CaptionOptions]], plans: List[Plan], reports: List[CaptionReport],
                as_json: bool) -> None:
    """Caption each folder into ``reports``, the model loaded once, on the first folder that needs it."""
    on_event = (lambda event: print(json.dumps(event), flush=True)) if as_json else None
    captioner = None
    for (folder, options), plan in zip(work, plans):
        if captioner is None and plan.todo:
            captioner = Captioner.load(options)
        reports.append(caption_folder(folder, options, captioner, on_event=on_event))


def print_summaries(reports: List[CaptionReport], as_json: bool, error: Optional[str] = None) -> None:
    """Each folder's summary (``--json``: one line each, the last with ``error`` when the run stopped)."""
    for index, report in enumerate(reports):
        if as_json:
            stopped = {"error": error} if error and index == len(reports) - 1 else {}
            print(json.dumps({"summary": {**report.to_dict(), **stopped}}), flush=True)
        elif report.captioned or report.skipped or report.failed or not error:
            print(report.summary())


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    reports: List[CaptionReport] = []
    try:
        work = jobs(args)
        problems = [p for _, options in work for p in options.problems()]
        if problems:
            raise UserError("; ".join(dict.fromkeys(problems)))
        plans = [plan_folder(folder, options) for folder, options in work]
        for warning in [w for plan in plans for w in plan.warnings]:
            print(f"warning: {warning}", file=sys.stderr)
        if args.dry_run:
            return dry_run(work, plans)
        for (folder, _), plan in zip(work, plans):
            check_writable(plan, folder)  # before the model loads (minutes for the default one)
        caption_all(work, plans, reports, args.json)
    except CaptionWriteError as exc:
        print_summaries(reports + [exc.report], args.json, error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summaries(reports, args.json)
    return 1 if any(report.failed for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
