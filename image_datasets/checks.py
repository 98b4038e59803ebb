"""Dataset checks: every problem of an image folder in one pass, with the file and what to do.

``check_dataset`` is the full check behind ``validate_dataset.py``. ``check_before_training``
runs the same checks in their fast form before any model loads: it refuses the data, or, when the
user allows it, returns the bad samples to skip.

Severity: an *error* makes training fail (the loader raises on that file); a *warning* trains, but
the result may not be what the user expects (a converted, rotated, upscaled or duplicated image).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

from loguru import logger
from PIL import Image, UnidentifiedImageError

from image_datasets.dataset import IMAGE_EXTENSIONS, file_hash, find_reference, target_size
from utils.errors import DataError

ERROR, WARNING = "error", "warning"
# Common image formats the loader skips; anything else (.json, .DS_Store) is not reported.
UNSUPPORTED_IMAGE_EXTENSIONS = (".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl",
                                ".jp2", ".jfif", ".ico", ".psd", ".svg", ".ppm", ".pgm", ".tga", ".dng")
DEFAULT_MAX_PIXELS = 40_000_000
# In fast mode, images up to this many pixels are still fully decoded (a few ms each); bigger ones
# get structural checks only (PNG chunk CRCs, JPEG end marker, WebP container size).
FAST_DECODE_MAX_PIXELS = 512 * 512
EXIF_ORIENTATION = 0x0112
HIGH_BIT_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")

# Group titles of the formatted report, in the order they are printed.
TITLES: Dict[str, str] = {
    "folder": "Dataset folder",
    "unreadable": "Cannot read the image",
    "truncated": "Truncated or corrupt image",
    "too-large": "Image over Pillow's size limit",
    "caption-missing": "Caption missing",
    "caption-encoding": "Caption is not UTF-8",
    "reference-missing": "Reference image missing",
    "reference-unreadable": "Reference image cannot be read",
    "mode": "Colour mode converted to RGB",
    "transparency": "Transparency dropped",
    "exif-rotation": "EXIF rotation applied",
    "small": "Smaller than the training size (upscaled)",
    "large": "Very large image",
    "caption-empty": "Empty caption",
    "caption-bom": "Caption starts with a byte-order mark",
    "reference-size": "Reference size differs from the target",
    "duplicate": "Duplicate images (same bytes)",
    "same-name": "Two images share one name",
    "orphan-caption": "Caption without an image (ignored)",
    "orphan-reference": "Reference without a target image (ignored)",
    "unsupported-ext": "Unsupported image format (ignored)",
    "clip": "Clip left out of training (cannot be decoded, too short, or no caption)",
}


@dataclass(frozen=True)
class Problem:
    """One finding: the file, error/warning, what is wrong and what to do."""

    path: Path
    severity: str  # ERROR or WARNING
    message: str
    fix: str
    code: str = ""  # a key of TITLES: the kind of problem
    sample: Optional[Path] = None  # for errors: the target image whose sample cannot train


@dataclass
class DatasetReport:
    """Every problem found in a dataset, and how many samples can train."""

    root: Path
    problems: List[Problem] = field(default_factory=list)
    ok_samples: int = 0
    total_samples: int = 0
    base: Optional[Path] = None  # paths are printed relative to this folder

    @property
    def errors(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    def bad_files(self) -> Set[Path]:
        """Target images whose sample cannot train (to skip); dataset-wide errors are not files."""
        return {p.sample for p in self.errors if p.sample is not None}

    def fatal(self) -> List[Problem]:
        """Errors no skipping can fix (missing folder, no images)."""
        return [p for p in self.errors if p.sample is None]

    def relative(self, path: Path) -> str:
        """``path`` as printed: relative to the dataset (or to the folder holding it and its references)."""
        base = (self.base or self.root).resolve()
        try:
            return str(Path(path).resolve().relative_to(base)) or str(path)
        except ValueError:
            return str(path)

    def format(self, severities: Sequence[str] = (ERROR, WARNING), limit: Optional[int] = None) -> str:
        """Human-readable report: a summary line, then problems grouped by severity and kind
        (at most ``limit`` files per kind when given)."""
        lines = [f"Dataset {self.root}: {self.total_samples} images, {self.ok_samples} ready to train, "
                 f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"]
        headings = {ERROR: "ERRORS: training would fail", WARNING: "WARNINGS: training works, but check these"}
        for severity in severities:
            found = [p for p in self.problems if p.severity == severity]
            if found:
                lines += ["", f"{headings[severity]} ({len(found)})"] + self._format_groups(found, limit)
        return "\n".join(lines)

    def _format_groups(self, problems: List[Problem], limit: Optional[int]) -> List[str]:
        by_code: Dict[str, List[Problem]] = defaultdict(list)
        for p in problems:
            by_code[p.code].append(p)
        order = list(TITLES)
        lines: List[str] = []
        for code in sorted(by_code, key=lambda c: order.index(c) if c in order else len(order)):
            group = by_code[code]
            fixes = {p.fix for p in group}
            lines.append(f"  {TITLES.get(code, code)} ({len(group)})")
            shared = len(group) > 1 and len(fixes) == 1  # one fix for all: say it once, under the group
            for p in group[:limit]:
                lines.append(f"    {self.relative(p.path)}: {p.message}")
                if not shared:
                    lines.append(f"      fix: {p.fix}")
            if limit is not None and len(group) > limit:
                lines.append(f"    ... and {len(group) - limit} more")
            if shared:
                lines.append(f"      fix (all {len(group)}): {group[0].fix}")
        return lines

    def verdict(self) -> str:
        """The last line of the CLI: can training run?"""
        if self.fatal() or (self.errors and not self.ok_samples):
            return f"Training would fail: fix the {len(self.errors)} error(s) above."
        if self.errors:
            return (f"Training would fail: fix the {len(self.errors)} error(s) above, or set "
                    f"data_config.skip_bad_samples: true to train without the {len(self.bad_files())} bad sample(s).")
        return f"OK: {self.ok_samples} sample(s) ready to train" + (
            f" ({len(self.warnings)} warning(s) above)." if self.warnings else ".")

    def to_dict(self) -> Dict[str, object]:
        """JSON-ready form (``--json``)."""
        return {"root": str(self.root), "total_samples": self.total_samples, "ok_samples": self.ok_samples,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "problems": [{**asdict(p), "path": str(p.path), "sample": str(p.sample) if p.sample else None}
                             for p in self.problems]}


@dataclass
class _ImageFacts:
    """What the checks need from one image file."""

    width: int  # as displayed (EXIF rotation applied), like the loader's ``image_size``
    height: int
    mode: str
    orientation: int
    transparent: Optional[bool]  # None: has alpha data but was not decoded (fast mode, big image)


class _Unreadable(Exception):
    """The image cannot be loaded: message, fix and problem code."""

    def __init__(self, message: str, fix: str, code: str = "unreadable"):
        super().__init__(message)
        self.message, self.fix, self.code = message, fix, code


# ---------------------------------------------------------------------------------------------
# Public entry points


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
    report = DatasetReport(root, base=_display_base(root, controls))
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
    limits = _Limits(img_size, multiple, min_size or img_size, max_pixels, fast)
    for image in images:
        report.problems += _check_sample(root, image, caption_ext, controls, limits)
    report.problems += _check_folder(root, files, images, caption_ext, controls)
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
    cli = _cli_command(img_dir, caption_ext, img_size, control_dirs)
    if report.fatal() or (report.errors and (not skip_bad or report.ok_samples == 0)):
        raise DataError(_error_message(report, cli))
    if report.warnings:
        kinds = Counter(TITLES.get(p.code, p.code) for p in report.warnings)
        summary = ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common())
        logger.warning(f"dataset {img_dir}: {len(report.warnings)} warning(s) ({summary}); run `{cli}` for the list")
    for sample, reasons in _errors_by_sample(report).items():
        logger.warning(f"skipping {report.relative(sample)}: {'; '.join(reasons)}")
    return report.bad_files()


def _cli_command(img_dir: str | Path, caption_ext: str, img_size: int, control_dirs: Sequence[str | Path]) -> str:
    """The validator command that reproduces this check in full."""
    flags = [f"--path {img_dir}", f"--img-size {img_size}"] + [f"--control-dir {d}" for d in control_dirs]
    if caption_ext != "txt":
        flags.append(f"--caption-ext {caption_ext}")
    return "python validate_dataset.py " + " ".join(flags)


def _error_message(report: DatasetReport, cli: str) -> str:
    """The errors, grouped (20 files per kind at most), and the way out."""
    lines = [report.format((ERROR,), limit=20), ""]
    if report.ok_samples == 0:
        lines.append("No sample can train.")
    elif report.fatal():
        lines.append("Fix the folders first.")
    else:
        lines.append(f"Fix them, or set data_config.skip_bad_samples: true to train without these "
                     f"{len(report.bad_files())} sample(s).")
    lines.append(f"Full report: {cli}")
    return "\n".join(lines)


def _errors_by_sample(report: DatasetReport) -> Dict[Path, List[str]]:
    reasons: Dict[Path, List[str]] = defaultdict(list)
    for p in report.errors:
        if p.sample is not None:
            where = "" if p.path == p.sample else f"{report.relative(p.path)}: "  # the caption or reference
            reasons[p.sample].append(where + p.message)
    return reasons


# ---------------------------------------------------------------------------------------------
# One sample: target image, caption, references


@dataclass(frozen=True)
class _Limits:
    img_size: int
    multiple: int
    min_size: int
    max_pixels: int
    fast: bool


def _check_sample(root: Path, image: Path, caption_ext: str, controls: List[Path], limits: _Limits) -> List[Problem]:
    """Problems of one target image, its caption and its references."""
    problems: List[Problem] = []
    facts = _check_image(image, image, limits.fast, problems, "unreadable")
    if facts is not None:
        problems += _size_problems(image, facts, limits)
    if not image.name.startswith("._"):  # a macOS metadata file: one error is enough, it has no caption
        problems += _caption_problems(image, caption_ext)
    key = str(image.relative_to(root).with_suffix(""))
    problems += _reference_problems(image, key, facts, controls, limits.fast)
    return problems


def _check_image(path: Path, sample: Path, fast: bool, problems: List[Problem], code: str) -> Optional[_ImageFacts]:
    """Read ``path``: an unreadable file becomes an error (``code``), a converted one a warning."""
    try:
        facts = _inspect(path, fast)
    except _Unreadable as exc:
        problems.append(Problem(path, ERROR, exc.message, exc.fix, code if exc.code == "unreadable" else exc.code,
                                sample))
        return None
    problems += _mode_problems(path, facts)
    return facts


def _inspect(path: Path, fast: bool) -> _ImageFacts:
    """Open the image as the loader would; raise ``_Unreadable`` where the loader would fail."""
    if path.stat().st_size == 0:
        raise _Unreadable("empty file (0 bytes)", "re-copy or re-export it, or delete it", "unreadable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # below the hard limit: we warn ourselves
        try:
            with Image.open(path) as img:
                return _read_facts(path, img, fast)
        except UnidentifiedImageError:
            raise _Unreadable(f"not an image Pillow can read ({_sniff(path)})",
                              "delete it, or replace it with a real png/jpg/webp file") from None
        except PermissionError:
            raise _Unreadable("permission denied", "make it readable (chmod a+r)") from None
        except Image.DecompressionBombError as exc:
            raise _Unreadable(f"{exc}".split(",")[0] + ": the loader refuses images this big",
                              "downscale it (a few thousand pixels on the long side is plenty)", "too-large") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's ways of saying "broken data"
            raise _Unreadable(f"truncated or corrupt ({exc})", "re-copy or re-export it, or delete it",
                              "truncated") from None


def _read_facts(path: Path, img: Image.Image, fast: bool) -> _ImageFacts:
    """What the loader will make of ``img``. Both modes run the same checks (so ``validate_dataset.py``
    and the trainer agree on every file): the file's structure always (a PNG's chunks and its end,
    which decoding alone pads over), and the pixels decoded, except a large file in ``fast`` mode
    whose structure is sound."""
    width, height = img.size
    mode = img.mode
    structure_ok = _structure_ok(path, img)
    decode = not fast or width * height <= FAST_DECODE_MAX_PIXELS or not structure_ok
    if decode:
        img.load()  # raises OSError on truncated data, as the loader would
    orientation = _orientation(img, decoded=decode)
    transparent: Optional[bool] = None
    if img.has_transparency_data:
        transparent = _alpha_used(img) if decode else None
    if orientation in (5, 6, 7, 8):  # 90-degree rotations swap the sides, as exif_transpose does
        width, height = height, width
    return _ImageFacts(width, height, mode, orientation, transparent)


def _structure_ok(path: Path, img: Image.Image) -> bool:
    """Cheap truncation checks without decoding pixels; False means "decode to be sure"."""
    fmt = img.format
    if fmt == "PNG":
        with Image.open(path) as again:
            again.verify()  # walks every chunk and checks its CRC; raises on a cut file
        return True
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fmt in ("JPEG", "MPO"):
            fh.seek(max(0, size - 4096))
            return b"\xff\xd9" in fh.read()  # end-of-image marker (trailing bytes after it are common)
        if fmt == "WEBP":
            header = fh.read(8)
            return header[:4] == b"RIFF" and int.from_bytes(header[4:8], "little") + 8 <= size
    return False


def _orientation(img: Image.Image, decoded: bool) -> int:
    """The EXIF orientation tag (1 when absent). Corrupt EXIF makes the loader fail: unreadable."""
    try:
        if img.format == "PNG" and not decoded and "exif" not in img.info:
            return 1  # a PNG's late eXIf chunk needs a full decode; the fast check skips it
        return int(img.getexif().get(EXIF_ORIENTATION, 1) or 1)
    except Exception as exc:  # noqa: BLE001 - any EXIF parse failure also breaks exif_transpose
        raise _Unreadable(f"corrupt EXIF metadata ({exc.__class__.__name__})",
                          "re-save it without metadata (e.g. `magick IN -strip OUT`)", "truncated") from None


def _alpha_used(img: Image.Image) -> bool:
    """True when some pixel is not fully opaque."""
    try:
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
    except ValueError:  # a rare mode Pillow cannot convert: assume the alpha matters
        return True
    return rgba.getchannel("A").getextrema()[0] < 255


def _sniff(path: Path) -> str:
    """A guess at what a non-image file really is, for the message."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if path.name.startswith("._"):
        return "a macOS metadata file"
    if head.lstrip().startswith(b"<"):
        return "HTML/XML text, maybe a failed download"
    if head[4:8] == b"ftyp":
        return f"a {head[8:12].decode('ascii', 'replace').strip()} container (HEIC/AVIF/MP4?)"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError:
        return "unknown data"


def _mode_problems(path: Path, facts: _ImageFacts) -> List[Problem]:
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


def _size_problems(path: Path, facts: _ImageFacts, limits: _Limits) -> List[Problem]:
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


def _reference_problems(target: Path, key: str, facts: Optional[_ImageFacts], controls: List[Path],
                        fast: bool) -> List[Problem]:
    """The target's reference in each control folder, found as the loader finds it."""
    problems: List[Problem] = []
    for n, folder in enumerate(controls):
        ref = find_reference(folder, key)
        if ref is None:
            problems.append(_missing_reference(target, key, folder, n))
            break  # the loader stops at the first gap: later folders are not used for this sample
        ref_facts = _check_image(ref, target, fast, problems, "reference-unreadable")
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


def _reference_size_problems(ref: Path, ref_facts: _ImageFacts, facts: _ImageFacts) -> List[Problem]:
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


def _check_folder(root: Path, files: List[Path], images: List[Path], caption_ext: str,
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


def _display_base(root: Path, controls: Iterable[Path]) -> Path:
    """Print paths relative to the folder holding the images and the reference folders."""
    return Path(os.path.commonpath([str(root.resolve())] + [str(c.resolve()) for c in controls]))
