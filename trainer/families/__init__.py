"""Model families behind one interface (see ``base.ModelFamily``)."""

from __future__ import annotations

from typing import Dict

from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.families.base import ModelFamily
from trainer.families.flux import FluxFamily
from trainer.families.kandinsky5 import Kandinsky5Family
from trainer.families.qwen_image import QwenImageFamily
from trainer.families.qwen_image_edit import QwenImageEditFamily
from trainer.families.z_image import ZImageFamily

FAMILIES: Dict[str, type] = {
    QwenImageFamily.name: QwenImageFamily,
    QwenImageEditFamily.name: QwenImageEditFamily,
    FluxFamily.name: FluxFamily,
    Kandinsky5Family.name: Kandinsky5Family,
    ZImageFamily.name: ZImageFamily,
}


def get_family(cfg: TrainConfig) -> ModelFamily:
    """The family named by ``cfg.family``, for the checkpoint ``cfg.pretrained_model_name_or_path``."""
    if cfg.family not in FAMILIES:
        raise ConfigError(f"key 'family': value '{cfg.family}' is not one of {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family](cfg)
