"""Clips + captions from a folder (``clip1.mp4`` + ``clip1.txt``) as training samples.

Each video's frames are resampled to the dataset's ``frame_rate`` (each frame the file's frame shown at that
time; none: the file's own frames), then clips of ``num_frames`` are drawn from it by ``clip_mode``: ``start``
(one clip, from the start), ``evenly_spaced`` (``clips_per_video`` clips spread from the start to the end) or
``consecutive`` (up to ``clips_per_video`` back-to-back clips from the start). A clip's frames are resized and
centre-cropped like an image. Scanning reads the containers' packets, never a frame: each clip is decoded once,
when its latents are encoded. A clip that cannot be read, or holds too few frames, is named in a warning and
left out: the run trains on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from image_datasets.checks import ERROR, WARNING, DatasetReport, Problem
from image_datasets.dataset import Sample, target_size
from image_datasets.video import DECODE_ERRORS, VIDEO_EXTENSIONS, VideoInfo, probe_video
from utils.errors import DataError

CLIP_MODES = ("start", "evenly_spaced", "consecutive")


@dataclass(frozen=True)
class Skipped:
    """A clip left out of training, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}; skipped"


@dataclass(frozen=True)
class ClipDrawing:
    """How clips are drawn from a video: frames per clip, the rate they are resampled to (None: the file's own
    frames), the mode and how many clips a video gives at most."""

    num_frames: int
    frame_rate: Optional[float] = None
    clip_mode: str = "start"
    clips_per_video: int = 1


def resampled_positions(info: VideoInfo, frame_rate: Optional[float]) -> np.ndarray:
    """For each frame of the video at ``frame_rate``, the position of the file's frame nearest its time (the
    earlier of two as near: containers round times to their clock); the file's own positions when ``frame_rate``
    is None or 0."""
    times = np.asarray(info.timestamps)
    if not frame_rate:
        return np.arange(len(times))
    last_lasts = 1 / info.frame_rate if info.frame_rate else 1 / frame_rate  # the last frame shows for one gap
    # The frames whose time falls within the video (a tenth of a frame spared: containers round times).
    count = max(1, int(np.ceil((times[-1] + last_lasts) * frame_rate - 0.1)))
    midpoints = (times[:-1] + times[1:]) / 2
    return np.searchsorted(midpoints, np.arange(count) / frame_rate, side="left")


def draw_clips(info: VideoInfo, drawing: ClipDrawing) -> List[Tuple[int, ...]]:
    """The file positions of each clip's frames; ``DataError`` when the video is shorter than one clip."""
    positions = resampled_positions(info, drawing.frame_rate)
    n, f = len(positions), drawing.num_frames
    if n < f:
        at = "" if n == info.frames else f" at {drawing.frame_rate:g} fps ({info.frames} in the file)"
        raise DataError(f"holds {n} frame(s){at}, fewer than num_frames={f}")
    if drawing.clip_mode == "consecutive":
        starts = list(range(0, n - f + 1, f))[:drawing.clips_per_video]
    elif drawing.clip_mode == "evenly_spaced":
        starts = sorted({int(s) for s in np.linspace(0, n - f, drawing.clips_per_video).round()})
    else:
        starts = [0]
    return [tuple(int(p) for p in positions[s:s + f]) for s in starts]


def probe_clip(path: Path, num_frames: int) -> Tuple[int, int]:
    """(width, height) of a clip that holds at least ``num_frames`` frames in the file; ``DataError`` saying what
    is wrong otherwise."""
    info = _probe(path)
    draw_clips(info, ClipDrawing(num_frames))
    return info.width, info.height


def _probe(path: Path) -> VideoInfo:
    try:
        return probe_video(path)
    except DECODE_ERRORS as exc:
        raise DataError(f"cannot decode the clip ({type(exc).__name__}: {str(exc) or 'no video stream'})") from None


def scan_video_folder(video_dir: str | Path, caption_ext: str, img_size: int, multiple: int,
                      num_frames: int | ClipDrawing) -> Tuple[List[Sample], List[Skipped]]:
    """Every readable video under ``video_dir`` (sorted) with its caption, as samples of clips drawn by
    ``num_frames`` (frames per clip from the start, or a ``ClipDrawing``), and the videos left out with the
    reason. ``DataError`` when none is left."""
    root = Path(video_dir)
    samples, skipped = read_video_folder(root, caption_ext, img_size, multiple, num_frames)
    if not samples:
        found = f"{len(skipped)} clip(s), none usable" if skipped else "no clips"
        reasons = "".join(f"\n  {s}" for s in skipped[:20])
        raise DataError(f"{root}: {found} (expected {', '.join(VIDEO_EXTENSIONS)} files with .{caption_ext} "
                        f"captions beside them){reasons}")
    return samples, skipped


def read_video_folder(root: Path, caption_ext: str, img_size: int, multiple: int,
                      num_frames: int | ClipDrawing) -> Tuple[List[Sample], List[Skipped]]:
    """The clips under ``root`` that train, and the videos left out with the reason."""
    drawing = num_frames if isinstance(num_frames, ClipDrawing) else ClipDrawing(num_frames)
    videos = sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file())
    samples: List[Sample] = []
    skipped: List[Skipped] = []
    for path in videos:
        try:
            samples += _clip_samples(root, path, caption_ext, img_size, multiple, drawing)
        except DataError as exc:
            skipped.append(Skipped(path, str(exc)))
    return samples, skipped


def _clip_samples(root: Path, path: Path, caption_ext: str, img_size: int, multiple: int,
                  drawing: ClipDrawing) -> List[Sample]:
    """A video's clips as samples (the first keyed by the file's stem, the next ones ``stem@2``, ...);
    ``DataError`` naming what is wrong with it."""
    caption_path = path.with_suffix(f".{caption_ext}")
    if not caption_path.is_file():
        raise DataError(f"caption file {caption_path.name} is missing")
    try:
        caption = caption_path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise DataError(f"caption {caption_path.name} is not UTF-8 text") from None
    info = _probe(path)
    if min(info.width, info.height) < multiple:
        raise DataError(f"is {info.width}x{info.height}, a side under the model's {multiple}-pixel grid")
    key = str(path.relative_to(root).with_suffix(""))
    size = target_size(info.width, info.height, img_size, multiple)
    return [Sample(key if i == 0 else f"{key}@{i + 1}", path, caption, size, original_size=(info.width, info.height),
                   frames=drawing.num_frames, frame_positions=_stored(positions))
            for i, positions in enumerate(draw_clips(info, drawing))]


def _stored(positions: Sequence[int]) -> Tuple[int, ...]:
    """A clip's frame positions as the sample keeps them: none for the file's first frames (the clips every
    earlier version trained on, whose cache keys stay the same)."""
    return () if tuple(positions) == tuple(range(len(positions))) else tuple(positions)


def check_clips(video_dir: str | Path, caption_ext: str, img_size: int, num_frames: int | ClipDrawing,
                multiple: int = 16) -> DatasetReport:
    """The dataset checker's report of a clip folder, agreeing with training: each video training would leave out
    is a warning naming why (the run skips it), no usable video at all is an error, and a variable frame rate
    is a warning (training resamples it by the frames' times)."""
    drawing = num_frames if isinstance(num_frames, ClipDrawing) else ClipDrawing(num_frames)
    root = Path(video_dir)
    report = DatasetReport(root, noun="clips")
    if not root.is_dir():
        report.problems.append(Problem(root, ERROR, "the folder does not exist", "fix video_dir", "folder"))
        return report
    samples, skipped = read_video_folder(root, caption_ext, img_size, multiple, drawing)
    if not samples:
        report.problems.append(Problem(root, ERROR, f"no usable clip of {len(skipped)}",
                                       f"add clips ({', '.join(VIDEO_EXTENSIONS)}) of at least "
                                       f"{drawing.num_frames} frames with .{caption_ext} captions", "folder"))
    report.problems += [Problem(s.path, WARNING, s.reason, "training leaves it out: replace or remove it", "clip")
                        for s in skipped]
    for path in sorted({s.image_path for s in samples}):
        info = probe_video(path)
        if info.variable_rate:
            report.problems.append(Problem(
                path, WARNING, f"variable frame rate (frames {1 / np.diff(info.timestamps).max():.3g} to "
                f"{1 / np.diff(info.timestamps).min():.3g} fps apart)",
                "training resamples it by the frames' times" + ("" if drawing.frame_rate else
                                                                 "; set frame_rate to train at an even rate"),
                "clip_rate"))
    report.ok_samples = len(samples)
    report.total_samples = len(samples) + len(skipped)
    return report
