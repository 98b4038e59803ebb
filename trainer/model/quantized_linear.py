"""Old import path, kept so existing imports work: the 8-bit W8A8 linear layer lives in
``trainer/quantization/w8a8_linear.py`` (a floor below the families).

This name is the same module object, not a copy, so an attribute set through either path is set in both.
"""

import sys

import trainer.quantization.w8a8_linear  # noqa: F401  (loads it)

# from sys.modules, not "import a.b as c": a package attribute of the same name (a function) would win
sys.modules[__name__] = sys.modules["trainer.quantization.w8a8_linear"]
