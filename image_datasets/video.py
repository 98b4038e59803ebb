"""Video files through PyAV (FFmpeg's libraries in process: no ``ffmpeg`` command is run): the first frames of a
clip, and writing small clips (tests, sample data). ``clips.py`` turns a folder of clips into training samples."""

from __future__ import annotations

import os
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import av
import numpy as np
from PIL import Image

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
# What PyAV raises on a file it cannot open or decode (FFmpegError covers invalid data, a truncated file, ...).
DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, IndexError, StopIteration)


@dataclass(frozen=True)
class VideoInfo:
    """What a clip's container says, read without decoding a frame: its size and every frame's time."""

    width: int
    height: int
    timestamps: Tuple[float, ...]  # seconds, each frame's presentation time, in order

    @property
    def frames(self) -> int:
        return len(self.timestamps)

    @property
    def frame_rate(self) -> float:
        """Frames per second from the median gap between frames (0 for a single frame)."""
        gaps = np.diff(self.timestamps)
        return float(1 / np.median(gaps)) if len(gaps) and np.median(gaps) > 0 else 0.0

    @property
    def variable_rate(self) -> bool:
        """Whether the gaps between frames differ by more than a tenth of the median gap (variable frame rate)."""
        gaps = np.diff(self.timestamps)
        return bool(len(gaps) > 1 and np.abs(gaps - np.median(gaps)).max() > 0.1 * np.median(gaps))


def probe_video(path: Path) -> VideoInfo:
    """The first video stream's size and frame times from its packets (demuxed, not decoded: cheap, and a file
    cut short loses its tail here). Raises one of ``DECODE_ERRORS`` when the file cannot be opened."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]  # IndexError: no video stream
        times = sorted(float(packet.pts * stream.time_base) for packet in container.demux(stream)
                       if packet.pts is not None and packet.size)
        width, height = stream.codec_context.width, stream.codec_context.height
    if not times or not width or not height:
        raise ValueError("no video frames")
    return VideoInfo(width, height, tuple(t - times[0] for t in times))


def frames_at(path: Path, indices: Sequence[int]) -> List[Image.Image]:
    """The frames at ``indices`` (positions in presentation order; repeats allowed, ascending) as RGB images,
    decoding the clip once up to the last of them. Fewer if the clip ends first."""
    wanted, last = set(indices), max(indices, default=-1)
    decoded = {}
    if wanted:
        with av.open(str(path)) as container:
            for position, frame in enumerate(container.decode(container.streams.video[0])):
                if position in wanted:
                    decoded[position] = frame.to_image().convert("RGB")
                if position >= last:
                    break
    return [decoded[i] for i in indices if i in decoded]


def first_frames(path: Path, count: int) -> List[Image.Image]:
    """The first ``count`` frames of the clip's first video stream as RGB images (fewer if it has fewer).
    Raises one of ``DECODE_ERRORS`` when the file cannot be opened or decoded."""
    frames: List[Image.Image] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]  # IndexError: no video stream
        for frame in container.decode(stream):
            frames.append(frame.to_image().convert("RGB"))
            if len(frames) == count:
                break
    return frames


def write_clip(path: Path, frames: Sequence[np.ndarray], fps: int = 8) -> Path:
    """Encode ``(H, W, 3)`` uint8 frames (even sides) into a clip with PyAV, for tests and the sample data:
    MPEG-4 Part 2 in .mp4 / .mov / .mkv, VP8 in .webm (codecs every FFmpeg build has)."""
    codec = "libvpx" if path.suffix.lower() == ".webm" else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's last frames
            container.mux(packet)
    return path


def write_mp4(path: Path, frames: Sequence[Image.Image], fps: float) -> Path:
    """A render as an H.264 .mp4 (yuv420p: what browsers and players play) at ``fps``, written next to ``path``
    and renamed onto it, so a reader never sees half a file. Odd sides lose their last row / column (4:2:0)."""
    width, height = frames[0].width // 2 * 2, frames[0].height // 2 * 2
    partial = path.with_name(f".{path.name}.partial")
    with av.open(str(partial), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18"}  # visually lossless: a sample is for looking at
        for image in frames:
            frame = av.VideoFrame.from_image(image.convert("RGB").crop((0, 0, width, height)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's last frames
            container.mux(packet)
    os.replace(partial, path)
    return path


def write_webp(path: Path, frames: Sequence[Image.Image], fps: float) -> Path:
    """A render as an animated .webp at ``fps`` that loops (a web page shows it inline in an ``<img>``), written
    next to ``path`` and renamed onto it."""
    partial = path.with_name(f".{path.name}.partial")
    first, *rest = [image.convert("RGB") for image in frames]
    first.save(partial, format="WEBP", save_all=True, append_images=rest, duration=round(1000 / fps), loop=0,
               quality=90)
    os.replace(partial, path)
    return path


def read_all_frames(path: Path) -> List[Image.Image]:
    """Every frame of a clip's first video stream as RGB images (tests, the dataset checker)."""
    return first_frames(path, -1)
