"""Check a training dataset before a run: every problem, with the file and what to do.

    python validate_dataset.py --path DIR [--config X.yaml] [--family F] [--caption-ext txt]
                               [--img-size N] [--control-dir D ...] [--json]

With ``--config`` the image size, caption extension and reference folders come from the profile
(flags win over it). Datasets of a family that trains on reference images (``--family
qwen_image_edit``) find ``control/`` or ``control_0/``, ``control_1/``, ... beside DIR as the trainer does.

Exit code: 0 when training can run (warnings allowed), 1 when an error would stop it,
2 for a usage or config mistake.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from trainer.config import load_config
from utils.errors import UserError
from trainer.families import SPECS  # the light specs: no diffusers, so --help stays instant


@dataclass
class Settings:
    """What the check needs from flags and config."""

    caption_ext: str = "txt"
    img_size: int = 1024
    control_dirs: List[str] = field(default_factory=list)
    family: Optional[str] = None


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="folder of images and captions (data_config.img_dir)")
    parser.add_argument("--config", help="training profile (YAML): img_size, caption_type, control dirs")
    parser.add_argument("--family", choices=list(SPECS), help="model family (the entry script's; wins over the config)")
    parser.add_argument("--caption-ext", help="caption file extension (default: txt or the config's)")
    parser.add_argument("--img-size", type=int, help="training size, longest side (default: 1024 or the config's)")
    parser.add_argument("--min-size", type=int, help="warn below this longest side (default: --img-size)")
    parser.add_argument("--control-dir", action="append", default=[], metavar="D",
                        help="reference folder for Edit, in order (repeat for several)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Flags over config over defaults; families that use references find their folders as the trainer does."""
    s = Settings(family=args.family)
    if args.config:
        overrides = [f"data_config.img_dir={args.path}"] + ([f"family={args.family}"] if args.family else [])
        cfg = load_config(args.config, overrides)
        d = cfg.data_config
        s = Settings(d.caption_type, d.img_size, [d.control_dir] if d.control_dir else list(d.control_dirs or []),
                     cfg.family)
    s.caption_ext = args.caption_ext or s.caption_ext
    s.img_size = args.img_size or s.img_size
    s.control_dirs = args.control_dir or s.control_dirs
    if _uses_references(s.family) and not s.control_dirs:
        from image_datasets.dataset import find_control_dirs  # imports torch: only when needed

        s.control_dirs = [str(p) for p in find_control_dirs(args.path, None, None)]
    return s


def _uses_references(family: Optional[str]) -> bool:
    return family is not None and SPECS[family].uses_references


def main(argv: Optional[List[str]] = None) -> int:
    """Check the dataset and print the report; the exit code says whether training can run."""
    args = parse_args(argv)
    try:
        s = resolve_settings(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Heavy imports (torch, through the dataset module) after the arguments and config are known good.
    from image_datasets.checks import ERROR, Problem, check_dataset
    from image_datasets.dataset import find_control_dirs

    if s.family is None and not s.control_dirs and find_control_dirs(args.path, None, None):
        users = " or ".join(name for name, spec in SPECS.items() if spec.uses_references)
        print(f"note: reference folders found beside {args.path}; pass --family {users} to check "
              "them as reference images", file=sys.stderr)
    report = check_dataset(args.path, s.caption_ext, s.img_size, control_dirs=s.control_dirs,
                           min_size=args.min_size)
    if _uses_references(s.family) and not s.control_dirs:  # the trainer refuses this before anything else
        report.problems.insert(0, Problem(Path(args.path), ERROR, f"{s.family} trains on reference images, "
                                          "and no control/ or control_0/ folder is beside this one",
                                          "add the reference folder, or name it with --control-dir / "
                                          "data_config.control_dir", "folder"))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
        print()
        print(report.verdict())
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
