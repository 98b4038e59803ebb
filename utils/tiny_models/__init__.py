"""Tiny, randomly initialised pipelines of every model family, for tests and the quick-start.

Each tiny model is derived from its family's published configs plus shrink overrides (litgpt's
``Config.from_name(name, **overrides)``): ``trainer/families/<name>/tiny.py`` holds the overrides and a
``build(out_dir, seed, checkpoint=None)``; nothing here lists families. A family's ``VARIANTS`` (tiny
name -> published checkpoint) adds tiny models of its other checkpoints (``qwen_image_edit_plus``).

Every builder uses the real diffusers/transformers classes, builds offline (tokenizers included), is
deterministic in ``seed`` (same seed -> byte-identical weights) and saves the normal diffusers folder
layout, so the result loads with the family's pipeline class ``from_pretrained`` like a real checkpoint.
The Edit families need the processor passed in where torchvision is missing:
``QwenImageEditPipeline.from_pretrained(d, processor=load_qwen_vl_processor(d))``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import utils.quiet  # noqa: F401  (before diffusers and transformers load: their known-harmless warnings)
from .vlm import build_tiny_vlm
from utils.qwen_processor import load_qwen_vl_processor, record_standard_processor, save_qwen_vl_processor


def _tiny_models() -> Dict[str, Tuple[Any, Optional[str]]]:
    """tiny model name -> (its family's ``tiny`` module, the published checkpoint it shrinks)."""
    from trainer.families import SPECS  # an entry point: may import upward (layers.py)

    found: Dict[str, Tuple[Any, Optional[str]]] = {}
    for name in SPECS:
        module = importlib.import_module(f"trainer.families.{name}.tiny")
        found[name] = (module, None)
        found.update({variant: (module, checkpoint) for variant, checkpoint in getattr(module, "VARIANTS", {}).items()})
    return found


def build_tiny_pipeline(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline ``family`` (one of FAMILIES) into ``out_dir`` and return its path."""
    models = _tiny_models()
    if family not in models:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(models)}")
    module, checkpoint = models[family]
    return module.build(Path(out_dir), seed, checkpoint)


def __getattr__(name: str) -> Any:
    # FAMILIES is computed on first use: the family tiny modules import this package's helpers.
    if name == "FAMILIES":
        return tuple(_tiny_models())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "build_tiny_pipeline",
    "build_tiny_vlm",
    "load_qwen_vl_processor",
    "record_standard_processor",
    "save_qwen_vl_processor",
]
