"""A run's dataset as the page shows it: the folders its config trains on, their images and captions,
and saving an edited caption.

The folders are the run's own config's (``data_config.img_dir`` and each ``datasets`` entry), read
as the loader reads them (``image_datasets/dataset.py``: images with ``IMAGE_EXTENSIONS`` anywhere
under the folder, the caption beside each with the folder's ``caption_type`` extension). A caption is
written only beside an image that is there, as ``<image stem>.<caption_type>``, whole (atomically).

Captioning a whole folder with a model is ``caption.py``'s, started by ``webui/captioning.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from image_datasets.dataset import IMAGE_EXTENSIONS
from trainer.config import FOLDER_KEYS
from trainer.run_folder.run_dir import write_text_atomic
from webui.paths import OutsideRoot, safe_join

MAX_ITEMS = 500  # images listed per folder (a page of thumbnails, not a browser for 100k images)
MAX_CAPTION_CHARS = 20_000


def folders(cfg: Dict[str, Any], project_root: Path) -> List[Dict[str, Any]]:
    """The image folders of a run's config, in order: path (relative ones from ``project_root``, where
    runs start), caption extension, and the dataset's name."""
    data = cfg.get("data_config") or {}
    entries = [(data.get("img_dir"), data, "data_config")]
    for i, entry in enumerate(cfg.get("datasets") or []):
        if isinstance(entry, dict):
            merged = {**{k: data[k] for k in FOLDER_KEYS if k in data}, **entry}
            entries.append((entry.get("img_dir"), merged, entry.get("name") or f"datasets.{i}"))
    out = []
    for img_dir, keys, name in entries:
        if img_dir:
            path = Path(str(img_dir))
            out.append({"path": path if path.is_absolute() else project_root / path,
                        "caption_type": str(keys.get("caption_type") or "txt"), "name": name})
    return out


def listing(folder: Dict[str, Any], limit: int = MAX_ITEMS) -> Dict[str, Any]:
    """A folder's images (relative paths) with their captions (None when missing), up to ``limit``."""
    root: Path = folder["path"]
    if not root.is_dir():
        return {"name": folder["name"], "path": str(root), "caption_type": folder["caption_type"], "items": [],
                "total": 0, "error": f"folder '{root}' does not exist"}
    base = root.resolve()
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                    and p.resolve().is_relative_to(base))
    items = [{"image": image.relative_to(root).as_posix(),
              "caption": read_caption(image.with_suffix(f".{folder['caption_type']}"), base)}
             for image in images[:limit]]
    return {"name": folder["name"], "path": str(root), "caption_type": folder["caption_type"], "items": items,
            "total": len(images), "error": None}


def read_caption(path: Path, base: Path) -> Optional[str]:
    """The caption in ``path`` (None when missing or unreadable); a link leading out of the folder
    ``base`` is not followed (it would show any file the server may read)."""
    try:
        if not path.resolve().is_relative_to(base):
            return None
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError, RuntimeError):  # RuntimeError: a symlink loop
        return None


def image_path(folder: Dict[str, Any], relative: str) -> Path:
    """An image of the folder (``OutsideRoot`` for anything else, including a caption or a path out)."""
    path = safe_join(folder["path"], relative)
    if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file():
        raise OutsideRoot(f"'{relative}' is not an image of {folder['name']}")
    return path


def save_caption(folder: Dict[str, Any], relative: str, caption: str) -> Path:
    """Write the caption of image ``relative`` beside it; returns the caption file."""
    if len(caption) > MAX_CAPTION_CHARS:
        raise ValueError(f"a caption of {len(caption)} characters is too long (at most {MAX_CAPTION_CHARS})")
    if not re.fullmatch(r"[A-Za-z0-9_]+", folder["caption_type"]) or f".{folder['caption_type'].lower()}" in IMAGE_EXTENSIONS:
        raise ValueError(f"caption_type '{folder['caption_type']}' is not a caption file extension such as txt")
    image = image_path(folder, relative)
    return write_text_atomic(image.with_suffix(f".{folder['caption_type']}"), caption.strip() + "\n")
