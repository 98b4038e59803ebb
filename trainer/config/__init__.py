"""A run's config, in four files by job:

- ``schema.py``: the typed sections (``TrainConfig`` and its parts), each checking its own values;
- ``loading.py``: ``load_config`` (YAML + ``key=value`` overrides, FlyMyAI's names, unknown keys, wrong
  types and impossible values reported at once and blamed on the override that caused them) and
  ``config_to_yaml``;
- ``interpolation.py``: what a value interpolates (OmegaConf's grammar on the parsed value) and
  ``no_resolvers``, the scope every config is read in;
- ``checks.py``: ``config_problems``, the rules across sections.

Import from here: ``from trainer.config import TrainConfig, load_config, ConfigError``.
"""

from utils.errors import ConfigError
from trainer.config.checks import (OPTIMIZER_KEYS, PRODIGY_LR_RANGE, config_problems, dataset_entries, optimizer_warnings,
                                   same_folder_warnings)
from trainer.config.loading import MAX_CONFIG_BYTES, config_to_yaml, flymyai_compat, load_config
from trainer.config.schema import (BUCKET_MODES, DESIGN_NOTE_KEYS, FLYMYAI_KEYS, FOLDER_KEYS, QUANTO_WEIGHTS,
                                   REGULARIZATION, ROLES, TORCHAO_WEIGHTS, WEIGHT_FORMATS, CudaFeatures, DataConfig,
                                   DatasetEntry, EVAL_ROLE, EvaluationConfig, FlyMyAIKeys, FolderKeys, QuantizationConfig, Section, TrainConfig,
                                   ValidationConfig, ValidationPrompt, choice_problems, dataset_name, one_of)

__all__ = [
    "BUCKET_MODES", "DESIGN_NOTE_KEYS", "FLYMYAI_KEYS", "FOLDER_KEYS", "MAX_CONFIG_BYTES", "OPTIMIZER_KEYS",
    "PRODIGY_LR_RANGE", "QUANTO_WEIGHTS", "REGULARIZATION", "ROLES", "TORCHAO_WEIGHTS", "WEIGHT_FORMATS",
    "ConfigError", "CudaFeatures", "DataConfig", "DatasetEntry", "EVAL_ROLE", "EvaluationConfig", "FlyMyAIKeys", "FolderKeys", "QuantizationConfig",
    "Section", "TrainConfig", "ValidationConfig", "ValidationPrompt", "choice_problems", "config_problems",
    "config_to_yaml", "dataset_entries", "dataset_name", "flymyai_compat", "load_config", "one_of",
    "optimizer_warnings", "same_folder_warnings",
]
