"""Write the small sample dataset used by the quick-start and the tests.

    python -m image_datasets.sample_data --out data/sample_dataset [--size 64] [--count 6] [--offset 0]
    python -m image_datasets.sample_data --out data/sample_videos --video-frames 9

Each image is a coloured shape on a plain background with a caption saying so, in the standard
layout (``img1.png`` + ``img1.txt``), across png/jpg/webp and one non-square image. With ``--video-frames`` each
sample is a clip of the shape sliding right (``clip1.mp4`` + ``clip1.txt``, mp4 and webm).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from image_datasets.video import write_clip

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 70), "blue": (40, 80, 220), "yellow": (240, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle")
FORMATS = ("png", "jpg", "webp")


def draw_sample(index: int, size: int) -> tuple[Image.Image, str]:
    """The ``index``-th image and its caption (deterministic)."""
    names = list(COLOURS)
    fg, bg = names[index % len(names)], names[(index + 3) % len(names)]
    shape = SHAPES[index % len(SHAPES)]
    width = size * 3 // 2 if index == 1 else size  # one landscape image exercises size grouping
    img = Image.new("RGB", (width, size), COLOURS[bg])
    draw = ImageDraw.Draw(img)
    m = size // 5
    box = (m, m, width - m, size - m)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[fg])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[fg])
    else:
        draw.polygon([(width // 2, m), (width - m, size - m), (m, size - m)], fill=COLOURS[fg])
    return img, f"a {fg} {shape} on a {bg} background"


def make_edit_dataset(out: Path, size: int = 64, count: int = 4, references: int = 1) -> Path:
    """An Edit dataset: ``images/`` (targets + instructions) and the reference folders
    (``control/``, or ``control_0/``, ``control_1/``, ... when ``references`` > 1). Returns ``images/``."""
    folders = ["control"] if references == 1 else [f"control_{k}" for k in range(references)]
    for sub in ["images", *folders]:
        (out / sub).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        target, caption = draw_sample(i, size)
        target.save(out / "images" / f"pair{i + 1}.png")
        for k, folder in enumerate(folders):
            source, _ = draw_sample(i + 1 + k, size)  # another colour and shape per reference
            source.resize(target.size).save(out / folder / f"pair{i + 1}.{FORMATS[k % len(FORMATS)]}")
        (out / "images" / f"pair{i + 1}.txt").write_text(f"turn it into {caption}\n", encoding="utf-8")
    return out / "images"


def make_sample_dataset(out: Path, size: int = 64, count: int = 6, offset: int = 0) -> Path:
    """Write ``count`` image/caption pairs into ``out`` and return it; ``offset`` starts at another
    sample (another set of colours and shapes, for a second dataset)."""
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        img, caption = draw_sample(i + offset, size)
        img.save(out / f"img{i + 1}.{FORMATS[i % len(FORMATS)]}", quality=95)
        (out / f"img{i + 1}.txt").write_text(caption + "\n", encoding="utf-8")
    return out


def make_video_dataset(out: Path, frames: int, size: int = 64, count: int = 4, offset: int = 0) -> Path:
    """Write ``count`` clips of ``frames`` frames with their captions into ``out`` and return it: each sample's
    image sliding right, ``size // 16`` pixels a frame."""
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        img, caption = draw_sample(i + offset, size)
        base = np.asarray(img.resize((img.width // 16 * 16, size)))  # even sides for yuv420p
        clip = [np.roll(base, shift=k * (size // 16), axis=1) for k in range(frames)]
        write_clip(out / f"clip{i + 1}.{('mp4', 'webm')[i % 2]}", clip, fps=16)  # Wan 2.1's rate: not resampled
        (out / f"clip{i + 1}.txt").write_text(caption.replace(" on ", " sliding right on ") + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/sample_dataset"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--offset", type=int, default=0, help="first sample to draw (another dataset's images)")
    parser.add_argument("--edit-references", type=int, default=0,
                        help="write an Edit dataset with this many reference folders instead")
    parser.add_argument("--video-frames", type=int, default=0, help="write clips of this many frames instead")
    args = parser.parse_args()
    if args.video_frames:
        print(make_video_dataset(args.out, args.video_frames, args.size, args.count, args.offset))
    elif args.edit_references:
        print(make_edit_dataset(args.out, args.size, args.count, args.edit_references))
    else:
        print(make_sample_dataset(args.out, args.size, args.count, args.offset))
