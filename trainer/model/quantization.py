"""Old import path, kept so existing imports work: the quantization of frozen weights lives in
``trainer/quantization/frozen_weights.py`` (a floor below the families).

This name is the same module object, not a copy, so an attribute set through either path is set in both.
"""

import sys

import trainer.quantization.frozen_weights  # noqa: F401  (loads it)

# from sys.modules, not "import a.b as c": a package attribute of the same name (a function) would win
sys.modules[__name__] = sys.modules["trainer.quantization.frozen_weights"]
