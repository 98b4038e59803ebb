"""Old import path, kept so existing imports work: the arithmetic of a step measurement lives in
``benchmarks/step_anatomy.py`` (beside the harness that uses it).

This name is the same module object, not a copy, so a name set through either path is set in both.
"""

import sys

import benchmarks.step_anatomy  # noqa: F401  (loads it)

sys.modules[__name__] = sys.modules["benchmarks.step_anatomy"]
