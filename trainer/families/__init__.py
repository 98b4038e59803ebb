"""Model families behind one interface (see ``base.ModelFamily``)."""

from __future__ import annotations

from typing import Dict, Optional

from trainer.errors import ConfigError
from trainer.families.base import ModelFamily
from trainer.families.qwen_image import QwenImageFamily

FAMILIES: Dict[str, type] = {
    QwenImageFamily.name: QwenImageFamily,
}


def get_family(name: Optional[str], model_path: str, revision: Optional[str] = None) -> ModelFamily:
    """Instantiate the family ``name`` for the checkpoint at ``model_path``."""
    if name not in FAMILIES:
        raise ConfigError(f"key 'family': value '{name}' is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name](model_path, revision)
