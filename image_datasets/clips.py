"""Clips + captions from a folder (``clip1.mp4`` + ``clip1.txt``) as training samples.

A clip trains on its first ``num_frames`` frames, each resized and centre-cropped like an image. A clip that
cannot be read, or holds fewer frames, is named in a warning and left out: the run trains on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from image_datasets.checks import ERROR, WARNING, DatasetReport, Problem
from image_datasets.dataset import Sample, target_size
from image_datasets.video import DECODE_ERRORS, VIDEO_EXTENSIONS, first_frames
from utils.errors import DataError


@dataclass(frozen=True)
class Skipped:
    """A clip left out of training, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}; skipped"


def probe_clip(path: Path, num_frames: int) -> Tuple[int, int]:
    """(width, height) of a clip that holds at least ``num_frames`` decodable frames; ``DataError`` saying what
    is wrong otherwise (the same frames training decodes, so a clip that passes here decodes there)."""
    try:
        frames = first_frames(path, num_frames)
    except DECODE_ERRORS as exc:
        raise DataError(f"cannot decode the clip ({type(exc).__name__}: {str(exc) or 'no video stream'})") from None
    if len(frames) < num_frames:
        raise DataError(f"holds {len(frames)} frame(s), fewer than num_frames={num_frames}")
    return frames[0].size


def scan_video_folder(video_dir: str | Path, caption_ext: str, img_size: int, multiple: int,
                      num_frames: int) -> Tuple[List[Sample], List[Skipped]]:
    """Every readable clip under ``video_dir`` (sorted) with its caption, as samples of ``num_frames`` frames, and
    the clips left out with the reason. ``DataError`` when none is left."""
    root = Path(video_dir)
    samples, skipped = read_video_folder(root, caption_ext, img_size, multiple, num_frames)
    if not samples:
        found = f"{len(skipped)} clip(s), none usable" if skipped else "no clips"
        reasons = "".join(f"\n  {s}" for s in skipped[:20])
        raise DataError(f"{root}: {found} (expected {', '.join(VIDEO_EXTENSIONS)} files with .{caption_ext} "
                        f"captions beside them){reasons}")
    return samples, skipped


def read_video_folder(root: Path, caption_ext: str, img_size: int, multiple: int,
                      num_frames: int) -> Tuple[List[Sample], List[Skipped]]:
    """The clips under ``root`` that train, and those left out with the reason."""
    clips = sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file())
    samples: List[Sample] = []
    skipped: List[Skipped] = []
    for path in clips:
        try:
            samples.append(_clip_sample(root, path, caption_ext, img_size, multiple, num_frames))
        except DataError as exc:
            skipped.append(Skipped(path, str(exc)))
    return samples, skipped


def _clip_sample(root: Path, path: Path, caption_ext: str, img_size: int, multiple: int, num_frames: int) -> Sample:
    """One clip as a sample; ``DataError`` naming what is wrong with it."""
    caption_path = path.with_suffix(f".{caption_ext}")
    if not caption_path.is_file():
        raise DataError(f"caption file {caption_path.name} is missing")
    try:
        caption = caption_path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise DataError(f"caption {caption_path.name} is not UTF-8 text") from None
    width, height = probe_clip(path, num_frames)
    key = str(path.relative_to(root).with_suffix(""))
    return Sample(key, path, caption, target_size(width, height, img_size, multiple), original_size=(width, height),
                  frames=num_frames)


def check_clips(video_dir: str | Path, caption_ext: str, img_size: int, num_frames: int) -> DatasetReport:
    """The dataset checker's report of a clip folder, agreeing with training: each clip training would leave out
    is a warning naming why (the run skips it), and no usable clip at all is an error."""
    root = Path(video_dir)
    report = DatasetReport(root)
    if not root.is_dir():
        report.problems.append(Problem(root, ERROR, "the folder does not exist", "fix video_dir", "folder"))
        return report
    samples, skipped = read_video_folder(root, caption_ext, img_size, 16, num_frames)
    if not samples:
        report.problems.append(Problem(root, ERROR, f"no usable clip of {len(skipped)}",
                                       f"add clips ({', '.join(VIDEO_EXTENSIONS)}) of at least {num_frames} frames "
                                       f"with .{caption_ext} captions", "folder"))
    report.problems += [Problem(s.path, WARNING, s.reason, "training leaves it out: replace or remove it", "clip")
                        for s in skipped]
    report.ok_samples = len(samples)
    report.total_samples = len(samples) + len(skipped)
    return report
