"""Old import path, kept so existing imports work: the optimizer table (each ``optimizer:`` choice's facts) lives in
``trainer/facts/optimizer_choices.py`` (the ground floor).

This name is the same module object, not a copy, so an attribute set through either path is set in both.
"""

import sys

import trainer.facts.optimizer_choices  # noqa: F401  (loads it)

# from sys.modules, not "import a.b as c": a package attribute of the same name (a function) would win
sys.modules[__name__] = sys.modules["trainer.facts.optimizer_choices"]
