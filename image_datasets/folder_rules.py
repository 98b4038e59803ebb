"""The rules of a dataset check: what makes one sample (target image, caption, references) or the
whole folder (duplicates, shared names, orphans, unsupported formats) a ``Problem``, and how bad.

The files themselves are read by ``image_files.py``; the findings are grouped and printed by
``dataset_report.py``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from image_datasets.dataset import IMAGE_EXTENSIONS, file_hash, find_reference, target_size
from image_datasets.dataset_report import ERROR, WARNING, Problem
from image_datasets.image_files import HIGH_BIT_DEPTH_MODES, ImageFacts, Unreadable, inspect_image

# Common image formats the loader skips; anything else (.json, .DS_Store) is not reported.
UNSUPPORTED_IMAGE_EXTENSIONS = (".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl",
                                ".jp2", ".jfif", ".ico", ".psd", ".svg", ".ppm", ".pgm", ".tga", ".dng")


# ---------------------------------------------------------------------------------------------
# One sample: target image, caption, references


@dataclass(frozen=True)
class Limits:
    img_size: int
    multiple: int
    min_size: int
    max_pixels: int
    fast: bool


def check_sample(root: Path, image: Path, caption_ext: str, controls: List[Path], limits: Limits) -> List[Problem]:
    """Problems of one target image, its caption and its references."""
    problems: List[Problem] = []
    facts = check_image(image, image, limits.fast, problems, "unreadable")
    if facts is not None:
        problems += _size_problems(image, facts, limits)
    if not image.name.startswith("._"):  # a macOS metadata file: one error is enough, it has no caption
        problems += _caption_problems(image, caption_ext)
    key = str(image.relative_to(root).with_suffix(""))
    problems += _reference_problems(image, key, facts, controls, limits.fast)
    return problems


def check_image(path: Path, sample: Path, fast: bool, problems: List[Problem], code: str) -> Optional[ImageFacts]:
    """Read ``path``: an unreadable file becomes an error (``code``), a converted one a warning."""
    try:
        facts = inspect_image(path, fast)
    except Unreadable as exc:
        problems.append(Problem(path, ERROR, exc.message, exc.fix, code if exc.code == "unreadable" else exc.code,
                                sample))
        return None
    problems += _mode_problems(path, facts)
    return facts


def _mode_problems(path: Path, facts: ImageFacts) -> List[Problem]:
    """Warnings for what the loader's ``convert("RGB")`` and ``exif_transpose`` do to this image."""
    mode, problems = facts.mode, []
    if mode == "CMYK":
        problems.append(Problem(path, WARNING, "CMYK: converted to RGB without colour management, colours may shift",
                                "convert it to sRGB (e.g. `magick IN -colorspace sRGB OUT.jpg`)", "mode"))
    elif mode in HIGH_BIT_DEPTH_MODES:
        problems.append(Problem(path, WARNING, f"high bit depth ({mode}): RGB conversion clips values above 255, "
                                "so it trains as a nearly white image", "convert it to 8-bit RGB "
                                "(e.g. `magick IN -depth 8 -colorspace sRGB OUT.png`)", "mode"))
    elif mode == "P":
        extra = "; transparent pixels take their hidden colour" if facts.transparent else ""
        problems.append(Problem(path, WARNING, f"palette image (256 colours): converted to RGB{extra}",
                                "save it as RGB (png or jpg)", "mode"))
    elif facts.transparent:
        problems.append(Problem(path, WARNING, f"{mode} with transparent pixels: the alpha channel is dropped, "
                                "transparent areas train as their hidden colour (often black)",
                                "flatten it onto the background you want (e.g. `magick IN -background white "
                                "-flatten OUT.png`)", "transparency"))
    elif mode not in ("RGB", "L", "LA", "RGBA", "RGBa", "La"):
        problems.append(Problem(path, WARNING, f"colour mode {mode}: converted to RGB",
                                "save it as 8-bit RGB", "mode"))
    if facts.orientation not in (0, 1):
        problems.append(Problem(path, WARNING, f"EXIF orientation {facts.orientation}: the loader rotates it "
                                "as a photo viewer shows it", "nothing if it looks right in a viewer; to be "
                                "explicit, save it rotated without the EXIF tag", "exif-rotation"))
    return problems


def _size_problems(path: Path, facts: ImageFacts, limits: Limits) -> List[Problem]:
    """Upscaled (blurry) or huge (slow, memory-hungry) target images."""
    w, h = facts.width, facts.height
    problems = []
    if max(w, h) < limits.min_size:
        tw, th = target_size(w, h, limits.img_size, limits.multiple)
        problems.append(Problem(path, WARNING, f"{w}x{h} is trained at {tw}x{th} (upscaled "
                                f"{max(tw, th) / max(w, h):.1f}x): expect blur",
                                "use a larger original, or lower data_config.img_size / --img-size", "small"))
    if w * h > limits.max_pixels:
        problems.append(Problem(path, WARNING, f"{w}x{h} ({w * h / 1e6:.0f} MP): slow to decode, "
                                f"~{w * h * 4 / 1e9:.1f} GB of memory while loading",
                                f"downscale it to about {limits.img_size} px on the long side", "large"))
    return problems


# ---------------------------------------------------------------------------------------------
# Captions


def _caption_problems(image: Path, caption_ext: str) -> List[Problem]:
    """The caption beside ``image``: missing or not UTF-8 (errors), empty or with a BOM (warnings)."""
    caption = image.with_suffix(f".{caption_ext}")
    if not caption.is_file():
        return [Problem(image, ERROR, f"caption file {caption.name} is missing",
                        _missing_caption_fix(image, caption), "caption-missing", image)]
    try:
        raw = caption.read_bytes()
        text = raw.decode("utf-8")
    except OSError as exc:
        return [Problem(caption, ERROR, f"cannot read the caption ({exc.strerror})", "fix its permissions",
                        "caption-encoding", image)]
    except UnicodeDecodeError as exc:
        guess = raw.decode("latin-1")[:60].strip()
        return [Problem(caption, ERROR, f"not UTF-8 (byte 0x{raw[exc.start]:02X} at offset {exc.start}; "
                        f"as Latin-1 it reads {guess!r})", "re-save it as UTF-8 "
                        "(e.g. `iconv -f latin1 -t utf-8 IN > OUT`)", "caption-encoding", image)]
    if text.startswith("\ufeff"):
        return [Problem(caption, WARNING, "starts with a UTF-8 byte-order mark, which becomes part of the prompt",
                        "re-save it as UTF-8 without BOM", "caption-bom")]
    if not text.strip():
        return [Problem(caption, WARNING, "empty caption: the image trains with an empty prompt",
                        "write a caption (or keep it empty on purpose)", "caption-empty")]
    return []


def _missing_caption_fix(image: Path, caption: Path) -> str:
    """Point at a near miss (other case, other extension) when there is one."""
    for other in sorted(image.parent.glob(f"{_glob_escape(image.stem)}.*")):
        if other == image or other.suffix.lower() in IMAGE_EXTENSIONS:
            continue
        if other.suffix.lower() == caption.suffix.lower():
            return f"rename {other.name} to {caption.name} (names are case-sensitive)"
        if other.suffix.lower() in (".txt", ".caption", ".json", ".md"):
            return (f"found {other.name}: set data_config.caption_type / --caption-ext to "
                    f"{other.suffix[1:]}, or write {caption.name}")
    return f"write the caption into {caption.name} (UTF-8), or remove the image"


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# ---------------------------------------------------------------------------------------------
# Edit references


def _reference_problems(target: Path, key: str, facts: Optional[ImageFacts], controls: List[Path],
                        fast: bool) -> List[Problem]:
    """The target's reference in each control folder, found as the loader finds it."""
    problems: List[Problem] = []
    for n, folder in enumerate(controls):
        ref = find_reference(folder, key)
        if ref is None:
            problems.append(_missing_reference(target, key, folder, n))
            break  # the loader stops at the first gap: later folders are not used for this sample
        ref_facts = check_image(ref, target, fast, problems, "reference-unreadable")
        if ref_facts is not None and facts is not None:
            problems += _reference_size_problems(ref, ref_facts, facts)
    return problems


def _missing_reference(target: Path, key: str, folder: Path, n: int) -> Problem:
    parent = (folder / key).parent
    near = sorted(p.name for p in parent.glob(f"{_glob_escape(Path(key).name)}.*")) if parent.is_dir() else []
    fix = (f"found {near[0]}: the loader reads only lower-case {'/'.join(IMAGE_EXTENSIONS)} names; "
           "rename or convert it" if near else f"add {key}.png (or .jpg/.webp) to {folder.name}/")
    if n == 0:
        return Problem(target, ERROR, f"no reference image {key}.* in {folder.name}/", fix, "reference-missing",
                       target)
    return Problem(target, WARNING, f"no reference {key}.* in {folder.name}/: this sample trains with {n} "
                   "reference(s), later folders are not used for it", fix, "reference-missing")


def _reference_size_problems(ref: Path, ref_facts: ImageFacts, facts: ImageFacts) -> List[Problem]:
    rw, rh, tw, th = ref_facts.width, ref_facts.height, facts.width, facts.height
    if (rw, rh) == (tw, th):
        return []
    other_aspect = abs(rw / rh - tw / th) > 0.01 * (tw / th)
    what = "another aspect ratio: the pair no longer lines up pixel for pixel" if other_aspect else \
        "same aspect ratio, resized by the pipeline"
    return [Problem(ref, WARNING, f"reference is {rw}x{rh}, target is {tw}x{th} ({what})",
                    "crop/resize the reference to the target's size if the two should match", "reference-size")]


# ---------------------------------------------------------------------------------------------
# Folder-wide: duplicates, shared names, orphans, unsupported formats


def check_folder(root: Path, files: List[Path], images: List[Path], caption_ext: str,
                 controls: List[Path]) -> List[Problem]:
    return (_duplicates(images) + same_name(root, images) + _orphan_captions(files, images, caption_ext)
            + _orphan_references(root, images, controls) + _unsupported(files, controls))


def _duplicates(images: List[Path]) -> List[Problem]:
    """Images with identical bytes; only files of equal size are hashed."""
    by_size: Dict[int, List[Path]] = defaultdict(list)
    for path in images:
        size = path.stat().st_size
        if size:
            by_size[size].append(path)
    problems = []
    for same_size in by_size.values():
        if len(same_size) < 2:
            continue
        first_of: Dict[str, Path] = {}
        for path in same_size:
            digest = file_hash(path)
            if digest in first_of:
                problems.append(Problem(path, WARNING, f"same bytes as {first_of[digest].name}: trained twice as often",
                                        "delete one copy (or keep both on purpose to weight it)", "duplicate"))
            else:
                first_of[digest] = path
    return problems


def same_name(root: Path, images: List[Path]) -> List[Problem]:
    """``img1.png`` and ``img1.jpg`` both read ``img1.txt`` (and the same references); also warned by
    caption.py, which would give the second the first's caption."""
    first: Dict[Path, Path] = {}
    problems = []
    for path in images:
        stem = path.with_suffix("")
        if stem in first:
            problems.append(Problem(path, WARNING, f"shares its name with {first[stem].name}: both use the same "
                                    "caption (and references)", "rename one of them", "same-name"))
        else:
            first[stem] = path
    return problems


def _orphan_captions(files: List[Path], images: List[Path], caption_ext: str) -> List[Problem]:
    used = {p.with_suffix(f".{caption_ext}") for p in images}
    problems = []
    for path in files:
        if path.suffix == f".{caption_ext}" and path not in used:
            skipped = [p.name for p in path.parent.glob(f"{_glob_escape(path.stem)}.*")
                       if p.suffix.lower() in UNSUPPORTED_IMAGE_EXTENSIONS]
            why = f" ({skipped[0]} is in an unsupported format)" if skipped else ""
            problems.append(Problem(path, WARNING, f"no image named {path.stem}.* beside it{why}",
                                    "add the image, or delete the caption", "orphan-caption"))
    return problems


def _orphan_references(root: Path, images: List[Path], controls: List[Path]) -> List[Problem]:
    keys = {str(p.relative_to(root).with_suffix("")) for p in images}
    problems = []
    for folder in controls:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS \
                    and str(path.relative_to(folder).with_suffix("")) not in keys:
                problems.append(Problem(path, WARNING, "no target image of this name: ignored",
                                        "add the target (and caption), or delete the reference", "orphan-reference"))
    return problems


def _unsupported(files: List[Path], controls: List[Path]) -> List[Problem]:
    found = list(files) + [p for folder in controls for p in sorted(folder.rglob("*")) if p.is_file()]
    return [Problem(p, WARNING, f"{p.suffix.lower()[1:].upper()} files are not loaded (only "
                    f"{', '.join(e[1:] for e in IMAGE_EXTENSIONS)}): ignored",
                    "convert it to png or jpg if it belongs to the dataset", "unsupported-ext")
            for p in found if p.suffix.lower() in UNSUPPORTED_IMAGE_EXTENSIONS]

