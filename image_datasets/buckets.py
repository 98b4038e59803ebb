"""Aspect-ratio buckets at a target area, and multi-resolution expansion of a dataset.

``longest_side`` (FlyMyAI's behaviour, the default) scales the longest side to the resolution;
``area`` puts each image in the bucket of nearest aspect ratio whose area is about resolution^2, so
a wide and a tall image cost about as many tokens as a square one.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import List, Sequence, Tuple

from image_datasets.dataset import Sample, target_size

Size = Tuple[int, int]


def aspect_buckets(resolution: int, multiple: int, max_ratio: float = 4.0) -> List[Size]:
    """Sizes (w, h), sides multiples of ``multiple``, area at most resolution^2, aspect up to ``max_ratio``."""
    area = resolution * resolution
    buckets = set()
    width = multiple
    while width <= resolution * math.sqrt(max_ratio):
        height = area // width // multiple * multiple
        if height >= multiple and max(width / height, height / width) <= max_ratio:
            buckets.add((width, height))
        width += multiple
    return sorted(buckets)


def nearest_bucket(width: int, height: int, buckets: Sequence[Size]) -> Size:
    """The bucket whose aspect ratio is closest (in log space: 2:1 and 1:2 are equally far from 1:1)."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ratio), -b[0] * b[1]))


def size_for(width: int, height: int, resolution: int, multiple: int, mode: str) -> Size:
    """The training size of a ``width`` x ``height`` image at ``resolution``."""
    if mode == "area":
        return nearest_bucket(width, height, aspect_buckets(resolution, multiple))
    return target_size(width, height, resolution, multiple)


def at_resolutions(samples: Sequence[Sample], resolutions: Sequence[int], multiple: int, mode: str) -> List[Sample]:
    """Each sample once per resolution (keys ``name@512``), sized by ``mode``."""
    out = []
    for resolution in resolutions:
        for s in samples:
            key = s.key if len(resolutions) == 1 else f"{s.key}@{resolution}"
            out.append(dataclasses.replace(s, key=key, size=size_for(*s.original_size, resolution, multiple, mode)))
    return out


def bucket_report(samples: Sequence[Sample]) -> str:
    """One line per size (and a clip's frames): how many samples train at it."""
    counts = Counter((s.size, s.frames) for s in samples)
    return ", ".join(f"{w}x{h}" + (f"x{frames}f" if frames else "") + f": {n}"
                     for ((w, h), frames), n in sorted(counts.items(), key=lambda kv: -kv[1]))
