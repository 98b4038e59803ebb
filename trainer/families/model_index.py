"""Reading a checkpoint's ``model_index.json`` and its components' configs (torch-free): the one place
that finds and parses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional


def read_model_index(name_or_path: str, revision: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The ``model_index.json`` of a local folder, or of a hub id in the HF cache; None when neither has it
    or it is unreadable (the download or ``from_pretrained`` names what is missing later)."""
    return read_checkpoint_json(name_or_path, "model_index.json", revision)


def read_checkpoint_json(name_or_path: str, filename: str, revision: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The JSON file ``filename`` (e.g. ``transformer/config.json``) of a local checkpoint folder, or of
    a hub id in the HF cache; None when neither has it or it is unreadable."""
    local = Path(name_or_path).expanduser() / filename
    if not local.is_file() and name_or_path.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, filename, revision=revision)
        local = Path(cached) if isinstance(cached, str) else local
    if not local.is_file():
        return None
    try:
        found = json.loads(local.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
