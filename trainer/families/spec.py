"""Old import path, kept so existing imports work: the fields of a family's spec (``FamilySpec`` and its parts) live
in ``trainer/facts/family_spec.py`` (the ground floor); each family's own spec stays in its package's ``spec.py``.

This name is the same module object, not a copy, so an attribute set through either path is set in both.
"""

import sys

import trainer.facts.family_spec  # noqa: F401  (loads it)

# from sys.modules, not "import a.b as c": a package attribute of the same name would win
sys.modules[__name__] = sys.modules["trainer.facts.family_spec"]
