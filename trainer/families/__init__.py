"""The model families: one package each (``<name>/spec.py`` facts, ``<name>/model.py`` runtime).

``SPECS`` is the one registry. It imports only the light spec modules, so config checks, the memory
planner, the dataset checker and inference can ask it without loading diffusers; ``load_family``
imports the runtime class of a run's family by name, when the run needs it.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

from utils.errors import ConfigError
from trainer.families.flux.spec import SPEC as FLUX
from trainer.families.kandinsky5.spec import SPEC as KANDINSKY5
from trainer.families.qwen_image.spec import SPEC as QWEN_IMAGE
from trainer.families.qwen_image_edit.spec import SPEC as QWEN_IMAGE_EDIT
from trainer.families.spec import FamilySpec
from trainer.families.z_image.spec import SPEC as Z_IMAGE

if TYPE_CHECKING:
    from trainer.families.base import ModelFamily

SPECS: Dict[str, FamilySpec] = {spec.name: spec for spec in (QWEN_IMAGE, QWEN_IMAGE_EDIT, FLUX, KANDINSKY5, Z_IMAGE)}


def family_spec(name: str) -> FamilySpec:
    """The spec of family ``name``; a ``ConfigError`` naming the known families otherwise."""
    if name not in SPECS:
        raise ConfigError(f"key 'family': value '{name}' is not one of {', '.join(SPECS)}")
    return SPECS[name]


def spec_for_pipeline(pipeline: str) -> Optional[FamilySpec]:
    """The family whose checkpoints use diffusers pipeline class ``pipeline`` (None when none does)."""
    return next((spec for spec in SPECS.values() if pipeline in spec.pipelines), None)


def load_family(cfg: Any) -> "ModelFamily":
    """The runtime family named by ``cfg.family``, for the checkpoint ``cfg.pretrained_model_name_or_path``."""
    module, _, cls = family_spec(cfg.family).runtime.partition(":")
    _refuse_other_families_model(cfg)
    return getattr(importlib.import_module(module), cls)(cfg)


def _refuse_other_families_model(cfg: Any) -> None:
    """A local model whose pipeline another family trains is refused: ``train.py`` given an Edit model
    would train it as plain Qwen-Image and ignore the reference images."""
    index = Path(os.path.expanduser(cfg.pretrained_model_name_or_path)) / "model_index.json"
    try:
        pipeline = json.loads(index.read_text()).get("_class_name", "")
    except (OSError, ValueError, AttributeError):
        return  # a hub id, or no readable index: the loader says what is wrong
    owner = spec_for_pipeline(pipeline)
    if owner is not None and owner.name != cfg.family:
        raise ConfigError(
            f"key 'pretrained_model_name_or_path': '{cfg.pretrained_model_name_or_path}' is a {pipeline} (family "
            f"{owner.name}) but this run trains family {cfg.family}: train it with {owner.entry_script} "
            f"(or set family: {owner.name})")
