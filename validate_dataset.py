"""Check a training dataset before a run: every problem, with the file and what to do.

    python validate_dataset.py --path DIR [--config X.yaml] [--family F] [--caption-ext txt]
                               [--img-size N] [--control-dir D ...] [--json]
    python validate_dataset.py --config X.yaml [--family F] [--json]

With ``--config`` the image size, caption extension and reference folders come from the profile
(flags win over it). With ``--config`` and no ``--path`` every dataset of the profile is checked
(each ``datasets`` entry with its own settings, or ``data_config.img_dir``), each reported under its
name; a ``video_dir`` is checked as training reads it (its first ``num_frames`` frames of each clip decoded: a clip
training would leave out is a warning, no usable clip an error). The family is ``--family``, else the profile's ``family`` key, else the one that trains the
profile's model (its model_index.json's pipeline; the Edit profiles name no family). Datasets of a
family that trains on reference images (Qwen-Image-Edit) find ``control/`` or ``control_0/``,
``control_1/``, ... beside DIR as the trainer does, and a missing reference is an error.

Exit code: 0 when training can run (warnings allowed), 1 when an error would stop it,
2 for a usage or config mistake.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from trainer.config import FolderKeys, dataset_entries, load_config, same_folder_warnings
from utils.errors import UserError
from trainer.families import SPECS, checkpoint_family  # the light specs: no diffusers, so --help stays instant


@dataclass
class Settings:
    """What the check needs from flags and config."""

    caption_ext: str = "txt"
    img_size: int = 1024
    control_dirs: List[str] = field(default_factory=list)
    family: Optional[str] = None


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="folder of images and captions (default: every dataset of --config)")
    parser.add_argument("--config", help="training profile (YAML): img_size, caption_type, control dirs")
    parser.add_argument("--family", choices=list(SPECS), help="model family (the entry script's; wins over the config)")
    parser.add_argument("--caption-ext", help="caption file extension (default: txt or the config's)")
    parser.add_argument("--img-size", type=int, help="training size, longest side (default: 1024 or the config's)")
    parser.add_argument("--min-size", type=int, help="warn below this longest side (default: --img-size)")
    parser.add_argument("--control-dir", action="append", default=[], metavar="D",
                        help="reference folder for Edit, in order (repeat for several)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


@dataclass
class Check:
    """One folder to check, with its settings and the name it is reported under."""

    path: str
    settings: Settings
    label: str = ""  # "datasets[1] (style)" when the config lists several
    num_frames: int = 0  # a clip folder (video_dir): the frames each clip trains on; 0: images
    drawing: Any = None  # a clip folder's ClipDrawing (frames, frame rate, clip mode), as training draws clips


def resolve_checks(args: argparse.Namespace) -> List[Check]:
    """The folders to check: ``--path``, or every dataset of ``--config``. Flags over config over
    defaults; families that use references find their folders as the trainer does."""
    if not args.path:
        if not args.config:
            raise UserError("give --path DIR (a folder of images and captions) or --config X.yaml (its datasets)")
        cfg = load_config(args.config, [f"family={args.family}"] if args.family else [])
        labelled, family = bool(cfg.datasets), _family(cfg)
        for warning in same_folder_warnings(cfg.datasets):
            print(f"warning: {warning}", file=sys.stderr)
        checks = []
        for i, entry in enumerate(dataset_entries(cfg)):
            label = f"datasets[{i}] ({entry.name})" if labelled else ""
            settings = lambda: Settings(entry.caption_type, entry.img_size, _controls(entry), family)  # noqa: E731
            if entry.img_dir:
                checks.append(_finish(args, entry.img_dir, settings(), label))
            if entry.video_dir:  # its clips, as training reads them
                checks.append(Check(entry.video_dir, settings(), label, num_frames=entry.num_frames or 1,
                                    drawing=_clip_drawing(entry, cfg, family)))
        return checks
    s = Settings(family=args.family)
    if args.config:
        overrides = ["datasets=[]", f"data_config.img_dir={args.path}"]
        overrides += [f"family={args.family}"] if args.family else []
        cfg = load_config(args.config, overrides)
        s = Settings(cfg.data_config.caption_type, cfg.data_config.img_size, _controls(cfg.data_config), _family(cfg))
    return [_finish(args, args.path, s)]


def _clip_drawing(entry: Any, cfg: Any, family: Optional[str]) -> Any:
    """How training draws the entry's clips: at its frame rate, else the model's (its VAE config where the model
    is a local folder, else the family's default)."""
    from trainer.data.data_mix import clip_drawing

    vae_config = Path(cfg.pretrained_model_name_or_path) / "vae" / "config.json"
    facts = json.loads(vae_config.read_text()) if vae_config.is_file() else {}
    return clip_drawing(entry, SPECS[family].frame_rate(facts) if family in SPECS else 0.0)


def _family(cfg: Any) -> Optional[str]:
    """The config's family (``--family`` or its ``family`` key), else the one that trains its model: the
    entry script for any other family refuses the model, so training checks references exactly then."""
    if cfg.family:
        return cfg.family
    family = checkpoint_family(cfg.pretrained_model_name_or_path, cfg.revision)
    if family is not None and SPECS[family].uses_references:
        print(f"note: family {family} (the one that trains {cfg.pretrained_model_name_or_path}): checking its "
              "reference images; --family F checks for another", file=sys.stderr)
    return family


def resolve_settings(args: argparse.Namespace) -> Settings:
    """The settings of ``--path`` (flags over config over defaults)."""
    return resolve_checks(args)[0].settings


def _controls(keys: FolderKeys) -> List[str]:
    return [keys.control_dir] if keys.control_dir else list(keys.control_dirs or [])


def _finish(args: argparse.Namespace, path: str, s: Settings, label: str = "") -> Check:
    """``s`` with the flags applied, and the reference folders found beside ``path`` when the family
    needs them and none are named."""
    s.caption_ext = args.caption_ext or s.caption_ext
    s.img_size = args.img_size or s.img_size
    s.control_dirs = args.control_dir or s.control_dirs
    if _uses_references(s.family) and not s.control_dirs:
        from image_datasets.dataset import find_control_dirs  # imports torch: only when needed

        s.control_dirs = [str(p) for p in find_control_dirs(path, None, None)]
    return Check(path, s, label)


def _uses_references(family: Optional[str]) -> bool:
    return family is not None and SPECS[family].uses_references


def _needs_references(family: Optional[str]) -> bool:
    """Whether the trainer refuses a dataset without reference folders (Qwen-Image-2.1 trains it text-to-image)."""
    return _uses_references(family) and not SPECS[family].references_optional


def main(argv: Optional[List[str]] = None) -> int:
    """Check the datasets and print the reports; the exit code says whether training can run."""
    args = parse_args(argv)
    try:
        checks = resolve_checks(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports = [(check, check_one(check, args)) for check in checks]
    if args.json:
        out = [{**({"dataset": c.label} if c.label else {}), **r.to_dict()} for c, r in reports]
        print(json.dumps(out[0] if len(out) == 1 and not checks[0].label else out, indent=2))
    else:
        for check, report in reports:
            if check.label:
                print(f"=== {check.label}: {check.path}")
            print(report.format())
            print()
            print(report.verdict())
            print()
    return 1 if any(report.errors for _, report in reports) else 0


def check_one(check: Check, args: argparse.Namespace) -> Any:
    """The report of one folder (its problems name their files)."""
    # Heavy imports (torch, through the dataset module) after the arguments and config are known good.
    from image_datasets.checks import ERROR, Problem, check_dataset
    from image_datasets.dataset import find_control_dirs

    s, path = check.settings, check.path
    if check.num_frames:
        from image_datasets.clips import check_clips

        return check_clips(path, s.caption_ext, s.img_size, check.drawing or check.num_frames)
    if s.family is None and not s.control_dirs and find_control_dirs(path, None, None):
        users = " or ".join(name for name, spec in SPECS.items() if spec.uses_references)
        print(f"note: reference folders found beside {path}; pass --family {users} to check "
              "them as reference images", file=sys.stderr)
    report = check_dataset(path, s.caption_ext, s.img_size, control_dirs=s.control_dirs, min_size=args.min_size)
    if _needs_references(s.family) and not s.control_dirs:  # the trainer refuses this before anything else
        report.problems.insert(0, Problem(Path(path), ERROR, f"{s.family} trains on reference images, "
                                          "and no control/ or control_0/ folder is beside this one",
                                          "add the reference folder, or name it with --control-dir / "
                                          "data_config.control_dir", "folder"))
    return report


if __name__ == "__main__":
    sys.exit(main())
