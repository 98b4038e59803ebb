"""Inspecting one image file as the training loader will open it: size as displayed, colour mode,
EXIF rotation, transparency, and whether it can be read at all (``inspect_image``).

Torch-free and rule-free: what counts as a problem is decided in ``folder_rules.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from PIL import Image, UnidentifiedImageError

# In fast mode, images up to this many pixels are still fully decoded (a few ms each); bigger ones
# get structural checks only (PNG chunk CRCs, JPEG end marker, WebP container size).
FAST_DECODE_MAX_PIXELS = 512 * 512
EXIF_ORIENTATION = 0x0112
HIGH_BIT_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")


@dataclass
class ImageFacts:
    """What the checks need from one image file."""

    width: int  # as displayed (EXIF rotation applied), like the loader's ``image_size``
    height: int
    mode: str
    orientation: int
    transparent: Optional[bool]  # None: has alpha data but was not decoded (fast mode, big image)


class Unreadable(Exception):
    """The image cannot be loaded: message, fix and problem code."""

    def __init__(self, message: str, fix: str, code: str = "unreadable"):
        super().__init__(message)
        self.message, self.fix, self.code = message, fix, code


def inspect_image(path: Path, fast: bool) -> ImageFacts:
    """Open the image as the loader would; raise ``Unreadable`` where the loader would fail."""
    if path.stat().st_size == 0:
        raise Unreadable("empty file (0 bytes)", "re-copy or re-export it, or delete it", "unreadable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # below the hard limit: we warn ourselves
        try:
            with Image.open(path) as img:
                return _read_facts(path, img, fast)
        except UnidentifiedImageError:
            raise Unreadable(f"not an image Pillow can read ({_sniff(path)})",
                             "delete it, or replace it with a real png/jpg/webp file") from None
        except PermissionError:
            raise Unreadable("permission denied", "make it readable (chmod a+r)") from None
        except Image.DecompressionBombError as exc:
            raise Unreadable(f"{exc}".split(",")[0] + ": the loader refuses images this big",
                             "downscale it (a few thousand pixels on the long side is plenty)", "too-large") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's ways of saying "broken data"
            raise Unreadable(f"truncated or corrupt ({exc})", "re-copy or re-export it, or delete it",
                             "truncated") from None


def _read_facts(path: Path, img: Image.Image, fast: bool) -> ImageFacts:
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
    return ImageFacts(width, height, mode, orientation, transparent)


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
        raise Unreadable(f"corrupt EXIF metadata ({exc.__class__.__name__})",
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

