"""The quick-start's programs print only their own lines: the known-harmless third-party warnings
(bitsandbytes' missing `kernels`, diffusers' experimental attention backends, torchao's kernels for
other platforms, transformers' missing torchvision) are silenced in one place, utils/quiet.py. The quick-start's
programs, each a fresh interpreter, are checked for them in tests/test_quickstart.py."""

from __future__ import annotations

import logging
from typing import List

import pytest

from utils.quiet import KNOWN_HARMLESS

# The messages as the libraries print them, written out here rather than taken from utils/quiet.py,
# so that a filter whose pattern matches nothing fails the test.
SAMPLES = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community: No module named "
                                     "'kernels'. Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
    "diffusers.models.modeling_utils": "Attention backends are an experimental feature and the API may be subject "
                                       "to change.",
    "torchao": "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
               "Could not load this library",
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                           "torch.compile as an opaque value type.",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects. This may affect "
                                                      "loading checkpoints serialized with `torchao`",
    "transformers.utils.import_utils": "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                                       "`CLIPImageProcessorPil` for backward compatibility.",
}
THIRD_PARTY = ("No module named 'kernels'", "Attention backends are an experimental feature", "torchao/_C",
               "is an Enum subclass", "Unable to import `torchao`", "requires torchvision (not installed)")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("name", [name for name, _ in KNOWN_HARMLESS])
def test_each_filter_drops_its_message_and_nothing_else(name: str) -> None:
    logger, collect = logging.getLogger(name), Collect()
    logger.addHandler(collect)
    try:
        for message in (SAMPLES[name], "some other warning of the same library"):
            # handle() applies the logger's filters whatever level a library has set on it
            logger.handle(logger.makeRecord(name, logging.WARNING, __file__, 0, message, (), None))
    finally:
        logger.removeHandler(collect)
    assert collect.messages == ["some other warning of the same library"]


def third_party_lines(output: str) -> List[str]:
    """The lines of ``output`` that are one of the known-harmless third-party warnings."""
    return [line for line in output.splitlines() if any(text in line for text in THIRD_PARTY)]
