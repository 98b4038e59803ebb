"""The old import path of the int8 W8A8 layer: everything lives in ``trainer/model/quantized_linear.py``."""

from trainer.model.quantized_linear import *  # noqa: F401,F403
from trainer.model.quantized_linear import (  # noqa: F401  (private names tests and benchmarks reach)
    _WHY_NOT, _WORKS, _kernel_takes, _probe_int8_matmul)
