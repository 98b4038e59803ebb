"""Tiny, randomly initialised Qwen-Image / Qwen-Image-Edit(-Plus) / FLUX.1-dev / FLUX.2 [klein] / Kandinsky 5 / Z-Image /
Krea 2 pipelines for tests.

Each builder uses the real diffusers/transformers classes, builds offline (tokenizers included), is
deterministic in `seed` (same seed -> byte-identical weights) and saves the normal diffusers folder
layout, so the result loads with the family's pipeline class `from_pretrained` like a real checkpoint.
The Edit families need the processor passed in where torchvision is missing:
`QwenImageEditPipeline.from_pretrained(d, processor=load_qwen_vl_processor(d))`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import utils.quiet  # noqa: F401  (before diffusers and transformers load: their known-harmless warnings)
from .flux import build_tiny_flux
from .flux2 import build_tiny_flux2
from .kandinsky5 import build_tiny_kandinsky5
from .krea2 import build_tiny_krea2
from .qwen_image import build_tiny_qwen_image
from .qwen_image_edit import build_tiny_qwen_image_edit
from .vlm import build_tiny_vlm
from .z_image import build_tiny_z_image
from utils.qwen_processor import load_qwen_vl_processor, record_standard_processor, save_qwen_vl_processor

_BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "qwen_image": build_tiny_qwen_image,
    "qwen_image_edit": lambda out, seed: build_tiny_qwen_image_edit(out, seed, plus=False),
    "qwen_image_edit_plus": lambda out, seed: build_tiny_qwen_image_edit(out, seed, plus=True),
    "flux": build_tiny_flux,
    "flux2": build_tiny_flux2,
    "kandinsky5": build_tiny_kandinsky5,
    "z_image": build_tiny_z_image,
    "krea2": build_tiny_krea2,
}
FAMILIES: tuple[str, ...] = tuple(_BUILDERS)


def build_tiny_pipeline(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline of `family` (one of FAMILIES) into `out_dir` and return its path."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return _BUILDERS[family](Path(out_dir), seed)


__all__ = [
    "FAMILIES",
    "build_tiny_flux",
    "build_tiny_flux2",
    "build_tiny_kandinsky5",
    "build_tiny_krea2",
    "build_tiny_pipeline",
    "build_tiny_qwen_image",
    "build_tiny_qwen_image_edit",
    "build_tiny_vlm",
    "build_tiny_z_image",
    "load_qwen_vl_processor",
    "record_standard_processor",
    "save_qwen_vl_processor",
]
