"""Tiny models derived from a family's published configs (litgpt's ``Config.from_name(name, **overrides)``).

A family's ``trainer/families/<name>/tiny.py`` names the published checkpoint it shrinks (a key of its
spec's ``hub_configs``) and the overrides that make it tiny; these helpers take every other value from
the published config, so the tiny model keeps the real scheduler, patching, channel layout and flags.
Text encoders are shrunk by class (``utils.tiny_models.text_encoders``), so a family whose encoder is
already known adds nothing there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import diffusers
import torch
from diffusers.utils import logging as diffusers_logging

from ._common import init_model


def published(spec: Any, checkpoint: str | None = None) -> Mapping[str, Any]:
    """The published configs of ``checkpoint`` (a key of ``spec.hub_configs``; default the reference one)."""
    if checkpoint is None:
        return spec.reference_checkpoint()
    if checkpoint not in spec.hub_configs:
        raise ValueError(f"{spec.name}: no published configs for {checkpoint!r}; choose one of "
                         f"{', '.join(spec.hub_configs)}")
    return spec.hub_configs[checkpoint]


def _config(configs: Mapping[str, Any], file: str) -> dict[str, Any]:
    return {key: value for key, value in configs[file].items() if not key.startswith("_")}


def shrunk_model(configs: Mapping[str, Any], component: str, seed: int,
                 seed_more: Optional[Callable[[Any], None]] = None, **overrides: Any) -> Any:
    """The diffusers model ``component`` (transformer, vae) of the published ``configs``, randomly
    initialised with ``overrides`` on top of its published config; ``seed_more(model)`` then fills, from
    the same seeded stream, what the class leaves empty or zero."""
    cls = getattr(diffusers, configs[f"{component}/config.json"]["_class_name"])
    config = {**_config(configs, f"{component}/config.json"), **overrides}

    def make() -> Any:
        model = cls.from_config(config)
        if seed_more is not None:
            with torch.no_grad():
                seed_more(model)
        return model

    return init_model(make, seed, component)


def published_scheduler(configs: Mapping[str, Any], **overrides: Any) -> Any:
    """The checkpoint's scheduler with its published config (``overrides`` only where the spec holds none)."""
    library, cls = configs["model_index.json"]["scheduler"]
    config = {**configs.get("scheduler/scheduler_config.json", {}), **overrides}
    return getattr(diffusers, cls).from_config({k: v for k, v in config.items() if not k.startswith("_")})


def pipeline_class(configs: Mapping[str, Any]) -> type:
    """The diffusers pipeline class the checkpoint's ``model_index.json`` names."""
    return getattr(diffusers, configs["model_index.json"]["_class_name"])


def save_pipeline(pipe: Any, out_dir: str | Path) -> Path:
    """Save a pipeline in the normal diffusers layout (model_index.json + one folder per component).
    A component passed as None (a processor written by hand afterwards) makes diffusers warn that it
    "cannot be saved": expected here, hence the quieter logging."""
    out = Path(out_dir)
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        pipe.save_pretrained(out, safe_serialization=True)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    return out
