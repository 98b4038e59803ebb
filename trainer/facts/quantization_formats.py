"""The quantization choices a config can make, without torch: each backend's weight formats and the
``QuantizationChoice`` a run resolves them to. The code that quantizes is ``trainer/quantization/``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight formats of each quantization backend (their implementations: trainer/quantization/frozen_weights.py).
QUANTO_WEIGHTS = ("qfloat8", "qint8", "qint4")
INT8_W8A8 = "int8_w8a8"  # torchao weights, int8 activations and matmuls (trainer/quantization/w8a8_linear.py)
FLOAT8_W8A8 = "float8_w8a8"  # the same in float8 e4m3 with torch._scaled_mm
AUTO = "auto"  # the fastest W8A8 format the device's one-time check finds right (frozen_weights.resolve_auto)
W8A8_WEIGHTS = (INT8_W8A8, FLOAT8_W8A8, AUTO)  # activations quantized too: QuantizedLinear
# The torchao config class of each weight-only format; quanto's formats are its own qtypes' names.
TORCHAO_CONFIGS = {"int8_weight_only": "Int8WeightOnlyConfig", "int4_weight_only": "Int4WeightOnlyConfig",
                   "float8_weight_only": "Float8WeightOnlyConfig"}
# int8_w8a8 and float8_w8a8 quantize the activations too and multiply in 8 bits; auto is the fastest of
# them the device's one-time check finds right (trainer/quantization/w8a8_linear.py: fastest_w8a8).
TORCHAO_WEIGHTS = (*TORCHAO_CONFIGS, INT8_W8A8, FLOAT8_W8A8, AUTO)
WEIGHT_FORMATS = {"quanto": QUANTO_WEIGHTS, "torchao": TORCHAO_WEIGHTS}
# The text encoder's format for ``auto``: it only runs forward, once, in the cache pass, so speed matters
# little there, and per-token 8-bit activations lose accuracy in an LLM's outlier channels (LLM.int8()).
TEXT_ENCODER_AUTO = "int8_weight_only"


@dataclass(frozen=True)
class QuantizationChoice:
    """Which library and weight format; ``None`` everywhere means no quantization."""

    backend: str  # quanto | torchao
    weights: str
    requested: str = ""  # what the config asked for, where it was resolved (``auto``)
    reason: str = ""  # why ``auto`` became ``weights``
