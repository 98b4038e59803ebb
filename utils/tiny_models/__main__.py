"""CLI: python -m utils.tiny_models --family qwen_image --out DIR [--seed N] [--force]

``--family vlm`` builds a tiny Qwen3-VL vision-language model instead, for trying ``caption.py`` offline
(its captions are random tokens: it checks the pipeline, not the captions)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from . import FAMILIES, build_tiny_pipeline, build_tiny_vlm
from ._common import folder_size

VLM = "vlm"
STAMP = "tiny_family.txt"  # which family the folder holds, so that building it again is a no-op


def stamp(family: str, seed: int) -> str:
    """What ``STAMP`` holds for a model built with these arguments."""
    return f"{family} seed={seed}"


def built_as(folder: Path) -> str | None:
    """How this CLI built ``folder`` (its stamp), or None."""
    path = folder / STAMP
    return path.read_text().strip() if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tiny_models", description=__doc__)
    parser.add_argument("--family", required=True, choices=[*FAMILIES, VLM],
                        help=f"a model family's pipeline, or {VLM!r}: a captioning model for caption.py")
    parser.add_argument("--out", required=True, type=Path, help="folder to create (diffusers layout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace a non-empty existing folder")
    args = parser.parse_args(argv)

    out: Path = args.out.resolve()
    if out.exists() and not out.is_dir():
        print(f"error: {out} exists and is not a folder", file=sys.stderr)
        return 2
    if out.is_dir() and any(out.iterdir()) and not args.force:
        if built_as(out) == stamp(args.family, args.seed):  # the README's and profiles' lines, run again
            print(f"{out}: the tiny {args.family} model is there already (--force builds it again)")
            return 0
        print(f"error: {out} is not empty; pass --force to replace it", file=sys.stderr)
        return 2

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target (same filesystem) and rename, so a half-built model never appears at `out`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if args.family == VLM:
            build_tiny_vlm(tmp / "model", seed=args.seed)
        else:
            build_tiny_pipeline(args.family, tmp / "model", seed=args.seed)
        (tmp / "model" / STAMP).write_text(stamp(args.family, args.seed) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rename(tmp / "old")  # moved aside, deleted with tmp below
    (tmp / "model").rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{out} ({folder_size(out) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
