"""The model families: one package each (``<name>/spec.py`` facts, ``<name>/model.py`` runtime).

``SPECS`` is the one registry. It imports only the light spec modules, so config checks, the memory
planner, the dataset checker and inference can ask it without loading diffusers; ``load_family``
imports the runtime class of a run's family by name, when the run needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, Optional

from utils.errors import ConfigError
from trainer.families.flux.spec import SPEC as FLUX
from trainer.families.flux2.spec import SPEC as FLUX2
from trainer.families.kandinsky5.spec import SPEC as KANDINSKY5
from trainer.families.qwen_image.spec import SPEC as QWEN_IMAGE
from trainer.families.qwen_image_edit.spec import SPEC as QWEN_IMAGE_EDIT
from trainer.families.spec import FamilySpec
from trainer.families.z_image.spec import SPEC as Z_IMAGE

if TYPE_CHECKING:
    from trainer.families.base import ModelFamily

SPECS: Dict[str, FamilySpec] = {spec.name: spec for spec in (QWEN_IMAGE, QWEN_IMAGE_EDIT, FLUX, FLUX2, KANDINSKY5,
                                                              Z_IMAGE)}


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
    return getattr(importlib.import_module(module), cls)(cfg)
