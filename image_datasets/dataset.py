"""Image + caption samples from a folder (``img1.png`` + ``img1.txt``), resized for a family.

Edit datasets add reference ("control") folders whose files share the target's stem:
``images/img1.png`` + ``images/img1.txt`` + ``control/img1.jpg`` (+ ``control_1/img1.png`` ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset, Sampler

from image_datasets.video import DECODE_ERRORS, first_frames, frames_at
from utils.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
# The aspect crops FlyMyAI's `random_ratio` picks from ("default" keeps the image's own ratio).
RANDOM_RATIOS = ((16, 9), None, (1, 1), (4, 3))


@dataclass(frozen=True)
class Sample:
    """One training pair. ``key`` is its path relative to the dataset folder, without extension."""

    key: str
    image_path: Path
    caption: str
    size: Tuple[int, int]  # (width, height) fed to the VAE
    references: Tuple[Path, ...] = ()  # reference images (Edit), in control-folder order
    reference_sizes: Tuple[Tuple[int, int], ...] = ()
    original_size: Tuple[int, int] = (0, 0)  # (width, height) of the file, EXIF rotation applied
    frames: int = 0  # a clip's frames (image_path is then a video file); 0: a still image
    # A clip's frames as positions in the file (resampled, or later in the video); (): its first ``frames``.
    frame_positions: Tuple[int, ...] = ()

    @property
    def group(self) -> Hashable:
        """Samples of one group stack into a batch: same target size, same reference sizes, same frames
        (stills keep the two-part group they always had, so their batches are drawn as before)."""
        return (self.size, self.reference_sizes, self.frames) if self.frames else (self.size, self.reference_sizes)

    def content_hash(self) -> str:
        """Hash of the image file's bytes: a changed image gets a new cache entry."""
        return file_hash(self.image_path)


def file_hash(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise unreadable_now(path, exc) from None


def unreadable_now(path: Path, exc: Exception) -> DataError:
    """An image that passed the dataset check but cannot be read during the run (moved, deleted,
    replaced, or its disk gone), as one line naming it and what to do."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    return DataError(f"{path}: cannot read the image during training ({reason}): it was moved, deleted or changed "
                     "after the dataset check; put it back (or remove it and its caption) and run the same "
                     "command again (with resume_from_checkpoint=latest to continue from the last checkpoint)")


def image_size(path: Path) -> Tuple[int, int]:
    """(width, height) as displayed, EXIF rotation applied."""
    with Image.open(path) as img:
        return ImageOps.exif_transpose(img).size


def target_size(width: int, height: int, img_size: int, multiple: int) -> Tuple[int, int]:
    """Longest side scaled to ``img_size`` (as FlyMyAI), then each side floored to ``multiple``."""
    scale = img_size / max(width, height)
    w = max(multiple, int(round(width * scale)) // multiple * multiple)
    h = max(multiple, int(round(height * scale)) // multiple * multiple)
    return w, h


ReferenceSizer = Callable[[int, int], Tuple[int, int]]


def find_control_dirs(img_dir: str | Path, control_dir: Optional[str], control_dirs: Optional[Sequence[str]]) -> List[Path]:
    """The reference folders: as configured, else beside ``img_dir``: ``control/`` or
    ``control_0/``, ``control_1/``, ... (the Edit dataset layout)."""
    if control_dirs:
        return [Path(d) for d in control_dirs]
    if control_dir:
        return [Path(control_dir)]
    parent = Path(img_dir).resolve().parent
    numbered = []
    while (parent / f"control_{len(numbered)}").is_dir():
        numbered.append(parent / f"control_{len(numbered)}")
    if numbered:
        return numbered
    return [parent / "control"] if (parent / "control").is_dir() else []


def scan_image_folder(
    img_dir: str | Path,
    caption_ext: str,
    img_size: int,
    multiple: int,
    control_dirs: Sequence[str | Path] = (),
    reference_size: Optional[ReferenceSizer] = None,
    exclude: Collection[Path] = frozenset(),
) -> List[Sample]:
    """All image/caption pairs under ``img_dir`` (sorted), each with its reference images from
    ``control_dirs`` (the first folder required for every target, later ones optional), less the
    ``exclude``d images. Raises ``DataError`` listing every problem."""
    root = Path(img_dir)
    excluded = {Path(p).resolve() for p in exclude}
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                    and p.resolve() not in excluded)
    if not images:
        raise DataError(f"{root}: no images found (expected {', '.join(IMAGE_EXTENSIONS)} files with "
                        f".{caption_ext} captions beside them)")
    samples, problems = [], []
    for path in images:
        caption_path = path.with_suffix(f".{caption_ext}")
        try:
            width, height = image_size(path)
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
            problems.append(f"{path}: cannot read the image ({exc.__class__.__name__}); remove or replace it")
            continue
        if not caption_path.is_file():
            problems.append(f"{path}: caption file {caption_path.name} is missing")
            continue
        try:
            caption = caption_path.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            problems.append(f"{caption_path}: not UTF-8 text; re-save it as UTF-8")
            continue
        key = str(path.relative_to(root).with_suffix(""))
        refs = _find_references(key, path, control_dirs, problems)
        try:
            ref_sizes = tuple(reference_size(*image_size(r)) for r in refs) if reference_size else ()
        except (OSError, UnidentifiedImageError) as exc:
            problems.append(f"{path}: a reference image cannot be read ({exc.__class__.__name__})")
            continue
        samples.append(Sample(key, path, caption, target_size(width, height, img_size, multiple), refs, ref_sizes,
                              (width, height)))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError(f"{len(problems)} problem(s) in {root}:\n  {shown}{more}")
    return samples


def add_trigger_word(samples: Sequence[Sample], trigger: Optional[str]) -> List[Sample]:
    """Captions with the trigger word in front (``"ohwx, a photo of ..."``), unless already there."""
    if not trigger:
        return list(samples)
    return [s if s.caption.startswith(trigger) else dataclasses.replace(s, caption=f"{trigger}, {s.caption}".rstrip(", "))
            for s in samples]


def shuffle_tags(caption: str, rng: random.Random, keep: int = 0) -> str:
    """Shuffle comma-separated tags, keeping the first ``keep`` in place (the trigger word)."""
    tags = [t.strip() for t in caption.split(",") if t.strip()]
    head, tail = tags[:keep], tags[keep:]
    rng.shuffle(tail)
    return ", ".join(head + tail)


def find_reference(folder: Path, key: str) -> Optional[Path]:
    """The reference image of sample ``key`` in control ``folder``: ``<folder>/<key><ext>`` for the first
    of IMAGE_EXTENSIONS that exists (exact, case-sensitive names; no glob, so ``img[1]`` is a name, not a
    pattern). The one rule for the loader and the dataset checks."""
    for ext in IMAGE_EXTENSIONS:
        candidate = Path(folder) / f"{key}{ext}"
        if candidate.is_file():
            return candidate
    return None


def _find_references(key: str, target: Path, control_dirs: Sequence[str | Path], problems: List[str]) -> Tuple[Path, ...]:
    """The reference of ``key`` in each control folder; a missing first one is a problem."""
    refs: List[Path] = []
    for n, folder in enumerate(control_dirs):
        found = find_reference(Path(folder), key)
        if found is not None:
            refs.append(found)
        elif n == 0:
            problems.append(f"{target}: no reference image {key}.* in control folder {folder}")
            break
        else:
            break  # later references are optional, but keep their order: stop at the first gap
    return tuple(refs)


def open_rgb(path: Path) -> Image.Image:
    """An image as RGB with EXIF rotation applied."""
    try:
        with Image.open(path) as img:
            return ImageOps.exif_transpose(img).convert("RGB")
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:  # Pillow's ways to fail on a file
        raise unreadable_now(path, exc) from None


def load_image(sample: Sample, rng: random.Random | None = None, random_crop: bool = False) -> torch.Tensor:
    """The sample's image as a ``(3, H, W)`` float tensor in [-1, 1] at ``sample.size``.

    With ``rng`` a random aspect crop is applied first (FlyMyAI's ``random_ratio``); with
    ``random_crop`` the crop window is placed at random instead of centred.
    """
    if sample.frames:  # a clip: (3, F, H, W), its first frames centre-cropped
        return read_clip(sample.image_path, sample.frames, sample.size, sample.frame_positions)
    return pixels_at(open_rgb(sample.image_path), sample.size, rng, random_crop)


def pixels_at(img: Image.Image, size: Tuple[int, int], rng: random.Random | None = None,
              random_crop: bool = False) -> torch.Tensor:
    """Cover-resize and crop ``img`` to ``size``; a ``(3, H, W)`` tensor in [-1, 1]."""
    if rng is not None:
        ratio = rng.choice(RANDOM_RATIOS)
        if ratio is not None:
            size = _fit_ratio(size, ratio)
    centering = (random.random(), random.random()) if random_crop else (0.5, 0.5)
    img = ImageOps.fit(img, size, method=Image.Resampling.BICUBIC, centering=centering)  # cover, then crop
    array = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def read_clip(path: Path, num_frames: int, size: Tuple[int, int], positions: Sequence[int] = ()) -> torch.Tensor:
    """The clip's frames at ``positions`` in the file (default: its first ``num_frames``) at ``size``
    (cover-resized, centre-cropped) as a ``(3, F, H, W)`` tensor in [-1, 1]."""
    try:
        frames = frames_at(path, positions) if positions else first_frames(path, num_frames)
    except DECODE_ERRORS as exc:
        raise unreadable_now(path, exc) from None
    if len(frames) < num_frames:
        raise unreadable_now(path, ValueError(f"{len(frames)} of {num_frames} frames"))
    return torch.stack([pixels_at(frame, size) for frame in frames], dim=1)


def _fit_ratio(size: Tuple[int, int], ratio: Tuple[int, int]) -> Tuple[int, int]:
    """Largest size with aspect ``ratio`` inside ``size``, keeping the size's grid multiple."""
    w, h = size
    multiple = _grid(w, h)
    rw, rh = ratio if w >= h else ratio[::-1]
    if w * rh > h * rw:
        w = h * rw // rh
    else:
        h = w * rh // rw
    return max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple)


def _grid(w: int, h: int) -> int:
    g = np.gcd(w, h)
    return int(g & -g)  # largest power of two dividing both sides


class ImageCaptionDataset(Dataset):
    """Index -> ``{"index", "caption"}``, plus the sample's cached tensors from ``features(index)``
    (``latents``, ``references``, ``text``, ...), plus ``pixels`` and ``reference_pixels`` when images
    are encoded live. Loader workers run this, so cached tensors are read off the training thread."""

    def __init__(self, samples: Sequence[Sample], features: Optional[Callable[[int], Dict[str, object]]] = None,
                 load_pixels: bool = False, random_ratio: bool = False, random_crop: bool | Sequence[bool] = False):
        self.samples = list(samples)
        self.features = features
        self.load_pixels = load_pixels
        self.random_ratio = random_ratio
        self.random_crop = random_crop  # for all samples, or per sample (several datasets)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Dict[str, object]:
        sample = self.samples[index]
        item: Dict[str, object] = {"index": index, "caption": sample.caption}
        if self.features is not None:
            item.update(self.features(index))
        if self.load_pixels:
            rng = random.Random() if self.random_ratio else None
            crop = self.random_crop if isinstance(self.random_crop, bool) else self.random_crop[index]
            item["pixels"] = load_image(sample, rng, crop)
            item["reference_pixels"] = [pixels_at(open_rgb(path), size)
                                        for path, size in zip(sample.references, sample.reference_sizes)]
        return item


def collate(items: List[Dict[str, object]]) -> Dict[str, object]:
    """Batch items of one size group: tensors stacked (latents, pixels), lists of tensors stacked per
    slot (references: one ``(B, ...)`` tensor per slot), anything else listed (indices, captions,
    text conditions of unequal lengths, which the family collates)."""
    batch: Dict[str, object] = {}
    for key, first in items[0].items():
        values = [item[key] for item in items]
        if isinstance(first, torch.Tensor):
            batch[key] = torch.stack(values)  # type: ignore[arg-type]
        elif isinstance(first, list):
            batch[key] = [torch.stack(slot) for slot in zip(*values)]  # type: ignore[call-overload]
        else:
            batch[key] = values
    return batch


class SizeGroupedBatchSampler(Sampler[List[int]]):
    """Batches whose samples share one group (latent size, reference sizes; for several datasets also
    the dataset), so they stack without padding and a batch never mixes groups.

    Each epoch shuffles within groups and then the batch order, from ``seed + epoch``; every sample
    appears ``repeats[index]`` times per epoch (once by default), so groups are drawn in proportion
    to their samples x repeats. The order depends on nothing but the seed and the epoch: a resumed
    run that skips the batches already done continues exactly. ``set_epoch`` is called by the engine.

    The batch size is kept as ``samples_per_batch``, not ``batch_size``: accelerate's ``BatchSamplerShard``
    reads a ``batch_size`` attribute as "every batch but the last is full", and then drops a round of
    batches after a group's short last batch and pads the epoch with batches that mix groups (ranks
    would step out of step). Without it, it deals whole batches round-robin and evens the last round
    out with whole batches from the epoch's start (see ``drawn``).
    """

    def __init__(self, sizes: Sequence[Hashable], batch_size: int, shuffle: bool = True, seed: int = 0,
                 repeats: Optional[Sequence[int]] = None):
        self.sizes = list(sizes)
        self.samples_per_batch = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.repeats = list(repeats) if repeats is not None else [1] * len(self.sizes)
        if len(self.repeats) != len(self.sizes) or min(self.repeats, default=1) < 1:
            raise ValueError("repeats: one count >= 1 per sample")
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self, epoch: int) -> List[List[int]]:
        """The batches of ``epoch``, in the order they are drawn."""
        rng = random.Random(self.seed + epoch)
        groups: Dict[Hashable, List[int]] = {}
        for index, size in enumerate(self.sizes):
            groups.setdefault(size, []).append(index)
        batches = []
        for size in sorted(groups, key=repr):
            drawn: List[int] = []
            for round_ in range(max(self.repeats[i] for i in groups[size])):
                # Each repeat is its own shuffled pass, so an image meets itself in a batch only
                # where two passes join.
                indices = [i for i in groups[size] if self.repeats[i] > round_]
                if self.shuffle:
                    rng.shuffle(indices)
                drawn += indices
            step = self.samples_per_batch
            batches += [drawn[i:i + step] for i in range(0, len(drawn), step)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def drawn(self, epoch: int, batches_done: int, processes: int = 1) -> List[int]:
        """How often each sample was drawn by a run of ``processes`` processes that finished epochs
        ``0 .. epoch - 1`` and the first ``batches_done`` batches (each process's) of ``epoch``.

        With several processes accelerate deals the batches round-robin and, when their number is not
        a multiple of ``processes``, evens the last round out with the epoch's first batches again:
        those samples are drawn twice."""
        counts = [epoch * r for r in self.repeats]  # every full epoch draws each sample `repeats` times ...
        if processes > 1 and len(self) % processes:
            for e in range(epoch):  # ... plus the batches that evened out its last round
                for batch in self.dealt(e, processes)[len(self):]:
                    for index in batch:
                        counts[index] += 1
        for batch in self.dealt(epoch, processes)[:batches_done * processes] if batches_done else []:
            for index in batch:
                counts[index] += 1
        return counts

    def dealt(self, epoch: int, processes: int) -> List[List[int]]:
        """The batches of ``epoch`` in the order the processes take them, round by round: the epoch's
        batches, then as many of its first ones again as even out the last round."""
        batches = self.batches(epoch)
        short = -len(batches) % processes
        return batches + (batches * processes)[:short]

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches(self.epoch))

    def __len__(self) -> int:
        counts: Dict[Hashable, int] = {}
        for size, repeats in zip(self.sizes, self.repeats):
            counts[size] = counts.get(size, 0) + repeats
        return sum(-(-n // self.samples_per_batch) for n in counts.values())
