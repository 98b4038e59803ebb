"""Reading a checkpoint's ``model_index.json`` (torch-free): the one place that finds and parses it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional


def read_model_index(name_or_path: str, revision: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The ``model_index.json`` of a local folder, or of a hub id in the HF cache; None when neither has it
    or it is unreadable (the download or ``from_pretrained`` names what is missing later)."""
    local = Path(name_or_path).expanduser() / "model_index.json"
    if not local.is_file() and name_or_path.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "model_index.json", revision=revision)
        local = Path(cached) if isinstance(cached, str) else local
    if not local.is_file():
        return None
    try:
        index = json.loads(local.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None
