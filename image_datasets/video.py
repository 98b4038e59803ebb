"""Video files through PyAV (FFmpeg's libraries in process: no ``ffmpeg`` command is run): the first frames of a
clip, and writing small clips (tests, sample data). ``clips.py`` turns a folder of clips into training samples."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import av
import numpy as np
from PIL import Image

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
# What PyAV raises on a file it cannot open or decode (FFmpegError covers invalid data, a truncated file, ...).
DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, IndexError, StopIteration)


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
