"""The old import path of the int8 W8A8 layer: it lives in ``trainer/model/quantized_linear.py`` with the
fp8 one (``Int8Linear`` is ``QuantizedLinear``)."""

from trainer.model.quantized_linear import *  # noqa: F401,F403
