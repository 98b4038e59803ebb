"""Dataset checks: every problem of an image folder in one pass, with the file and what to do.

``check_dataset`` is the full check behind ``validate_dataset.py``. ``check_before_training``
runs the same checks in their fast form before any model loads: it refuses the data, or, when the
user allows it, returns the bad samples to skip.

Severity: an *error* makes training fail (the loader raises on that file); a *warning* trains, but
the result may not be what the user expects (a converted, rotated, upscaled or duplicated image).

The work is split by job: ``image_files.py`` reads one image file, ``folder_rules.py`` turns what
it finds into problems, ``dataset_report.py`` groups and prints them. This module runs them; the
names users import from it are re-exported here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional, Sequence, Set

from loguru import logger

from image_datasets.dataset import IMAGE_EXTENSIONS
from image_datasets.dataset_report import (ERROR, TITLES, WARNING, DatasetReport, Problem, cli_command,  # noqa: F401
                                           display_base, error_message, errors_by_sample)
from image_datasets.folder_rules import (UNSUPPORTED_IMAGE_EXTENSIONS, Limits, check_folder, check_sample,  # noqa: F401
                                         same_name)
from image_datasets.image_files import (ALPHA_MODES, EXIF_ORIENTATION, FAST_DECODE_MAX_PIXELS,  # noqa: F401
                                        HIGH_BIT_DEPTH_MODES, ImageFacts, Unreadable, inspect_image)
from utils.errors import DataError

DEFAULT_MAX_PIXELS = 40_000_000


def check_dataset(
    img_dir: str | Path,
    caption_ext: str = "txt",
    img_size: int = 1024,
    multiple: int = 16,
    control_dirs: Sequence[str | Path] = (),
    min_size: Optional[int] = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    fast: bool = False,
) -> DatasetReport:
    """Check every file of an image/caption folder (and its Edit reference folders).

    ``min_size``: warn when the longest side is below it (default ``img_size``: any upscale).
    ``fast``: decode only small images fully; bigger ones get header and structure checks.
    """
    root = Path(img_dir)
    controls = [Path(d) for d in control_dirs]
    report = DatasetReport(root, base=display_base(root, controls))
    if not root.is_dir():
        report.problems.append(Problem(root, ERROR, "folder does not exist",
                                       "check data_config.img_dir / --path", "folder"))
        return report
    files = sorted(p for p in root.rglob("*") if p.is_file())
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    report.total_samples = len(images)
    if not images:
        report.problems.append(Problem(root, ERROR, f"no images found (expected {', '.join(IMAGE_EXTENSIONS)} "
                                       f"files with .{caption_ext} captions beside them)",
                                       "point --path / data_config.img_dir at the folder of images", "folder"))
    for folder in controls:
        if not folder.is_dir():
            report.problems.append(Problem(folder, ERROR, "reference folder does not exist",
                                           "check data_config.control_dir(s) / --control-dir", "folder"))
    controls = [c for c in controls if c.is_dir()]
    limits = Limits(img_size, multiple, min_size or img_size, max_pixels, fast)
    for image in images:
        report.problems += check_sample(root, image, caption_ext, controls, limits)
    report.problems += check_folder(root, files, images, caption_ext, controls)
    bad = report.bad_files()
    report.ok_samples = sum(1 for image in images if image not in bad)
    return report


def check_before_training(
    img_dir: str | Path,
    caption_ext: str,
    img_size: int,
    multiple: int,
    control_dirs: Sequence[str | Path] = (),
    skip_bad: bool = False,
) -> Set[Path]:
    """The fast checks the trainer runs before loading any model. Returns the target images to skip.

    Raises ``DataError`` (errors listed) when a sample cannot train and ``skip_bad`` is false, when the
    folders themselves are wrong, or when no sample is left. With ``skip_bad`` logs one warning per
    skipped image. Warnings are summarised in one line (the CLI lists them).
    """
    if img_size % multiple:  # the sizes are floored to the model's pixel multiple: say so
        logger.warning(f"data_config.img_size {img_size} is not a multiple of {multiple} (the model's pixel "
                       f"multiple): images are sized to at most {img_size // multiple * multiple}")
    report = check_dataset(img_dir, caption_ext, img_size, multiple, control_dirs, fast=True)
    cli = cli_command(img_dir, caption_ext, img_size, control_dirs)
    if report.fatal() or (report.errors and (not skip_bad or report.ok_samples == 0)):
        raise DataError(error_message(report, cli))
    if report.warnings:
        kinds = Counter(TITLES.get(p.code, p.code) for p in report.warnings)
        summary = ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common())
        logger.warning(f"dataset {img_dir}: {len(report.warnings)} warning(s) ({summary}); run `{cli}` for the list")
    for sample, reasons in errors_by_sample(report).items():
        logger.warning(f"skipping {report.relative(sample)}: {'; '.join(reasons)}")
    return report.bad_files()

