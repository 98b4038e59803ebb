"""Old import path, kept so existing imports work: the GPU harness lives in ``benchmarks/harness.py`` (the
benchmarks measure with it, and they import nothing from tests/: the tests import the benchmarks' tools).

This name is the same module object, not a copy, so a name set through either path (a test's monkeypatch)
is set in both.
"""

import sys

import benchmarks.harness  # noqa: F401  (loads it)

sys.modules[__name__] = sys.modules["benchmarks.harness"]
