"""Old import paths of the families' runtimes, kept so existing imports work: each family's class lived in
``trainer/families/<name>/model.py`` and now lives in ``<name>/family.py`` ("model" names the trainable
transformer, ``trainer/model/``, and nothing else).

``import trainer.families.<name>.model`` (and ``monkeypatch.setattr("trainer.families.<name>.model.X", ...)``)
gives the same module object as ``trainer.families.<name>.family``, not a copy, so a name set through either path
is seen through both. One finder answers for every family instead of a redirect file per family, so no file
named ``model.py`` is left under ``trainer/families/``. Light: importlib only (the package registry imports it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from types import ModuleType
from typing import Collection, Optional, Sequence

OLD_NAME = re.compile(r"trainer\.families\.([a-z0-9_]+)\.model")


class OldRuntimePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``trainer.families.<name>.model`` for each family in ``families`` and loads it as
    ``trainer.families.<name>.family``."""

    def __init__(self, families: Collection[str]) -> None:
        self.families = frozenset(families)

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        match = OLD_NAME.fullmatch(fullname)
        if match is None or match.group(1) not in self.families:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.name.removesuffix(".model") + ".family")
        # the import system sets __spec__ on what this returns; the real module keeps its own (restored below)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # already run as .family: only give its spec back


def install(families: Collection[str]) -> None:
    """Lets the old paths of ``families`` import (once per process: a second call changes nothing)."""
    if not any(isinstance(finder, OldRuntimePaths) for finder in sys.meta_path):
        sys.meta_path.append(OldRuntimePaths(families))
