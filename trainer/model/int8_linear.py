"""The old import path of the int8 W8A8 layer: it lives in ``trainer/quantization/w8a8_linear.py`` with the
fp8 one (``Int8Linear`` is ``QuantizedLinear``)."""

from trainer.quantization.w8a8_linear import *  # noqa: F401,F403
