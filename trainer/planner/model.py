"""Old import path, kept so existing imports work: the planner's model sizes live in
``trainer/planner/model_sizes.py`` (a name that says what it holds).

This name is the same module object, not a copy, so an attribute set through either path is set in both.
"""

import sys

import trainer.planner.model_sizes  # noqa: F401  (loads it)

# from sys.modules, not "import a.b as c": a package attribute of the same name (a function) would win
sys.modules[__name__] = sys.modules["trainer.planner.model_sizes"]
