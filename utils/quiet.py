"""Third-party messages that are neither ours nor actionable, silenced in one place.

Importing this module installs the filters; it must come before diffusers, transformers or peft
load (``trainer/__init__.py`` and ``utils/tiny_models/__init__.py`` import it first, so every entry
script and the tiny-model builder are covered). Each filter drops one known message of one logger,
so anything else those loggers say still shows.

Why these are not avoided by importing lazily: peft imports bitsandbytes whenever it is installed
(``peft/helpers.py``), and transformers imports torchao whenever it is installed
(``transformers.quantizers``); diffusers' pipelines import both libraries at once, and the trainer
needs them.
"""

from __future__ import annotations

import logging
import re
from typing import Tuple

# (logger, message pattern): why the message is harmless here.
KNOWN_HARMLESS: Tuple[Tuple[str, str], ...] = (
    # bitsandbytes' optional CPU kernel for 4-bit inference (`pip install kernels`); 8-bit AdamW,
    # the only thing the trainer uses bitsandbytes for, does not need it.
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # Said on every set_attention_backend call; utils/attention.py picks diffusers' stable default,
    # "native" (torch SDPA), and orders torch's own kernels itself.
    ("diffusers.models.modeling_utils", r"Attention backends are an experimental feature"),
    # torchao's prebuilt kernels for other Python versions and GPUs; its weight-only quantization
    # (the only torchao feature used) runs without them.
    ("torchao", r"Failed to load .*_C\S*\.so|Skipping import of cpp extensions"),
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported"),  # torchao's import
    ("diffusers.quantizers.torchao.torchao_quantizer", r"Unable to import `torchao` Tensor objects"),
    # transformers' PIL image processors serve these pipelines; torchvision is not a requirement.
    ("transformers.utils.import_utils", r"requires torchvision \(not installed\); falling back to"),
)


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message matches a pattern."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_warnings() -> None:
    """Install the filters of ``KNOWN_HARMLESS`` (once per logger and pattern)."""
    for name, pattern in KNOWN_HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))


quiet_known_warnings()
