"""Imports point one way: utils/ (platform) <- image_datasets/ <- trainer/ <- entry scripts.

The project's imports are read with ``ast``, module-level and function-local ones alike (a local
import that dodges a cycle is still a cycle), and the tests fail on any import cycle and on any import
that points up the layers. ``utils/validate_dataset.py`` is an entry point at the path the
project's guide gives (``python utils/validate_dataset.py --path DIR``): it sits with the entry scripts'
layer, and nothing may import it. So do the tiny models' registry and command (``utils.tiny_models`` and
its ``__main__``, ``python -m utils.tiny_models --family X``): each tiny model is its family's
(``trainer/families/<name>/tiny.py``), so the registry reads the family registry; the helpers beside it
(``derive``, ``text_encoders``, ``tokenizers``) know no family and stay in ``utils/``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
ENTRY_LAYER = 3
# then the entry scripts at the root, and the web page's package (webui/, started by webui.py): 3
LAYERS = {"utils": 0, "image_datasets": 1, "trainer": 2, "webui": ENTRY_LAYER}
# Entry points inside a package, run as files and never imported.
ENTRY_POINTS = ("utils.validate_dataset", "utils.tiny_models", "utils.tiny_models.__main__")

Edges = Dict[str, Dict[str, int]]  # module -> {imported project module: line of the first import}


def project_modules() -> Dict[str, Path]:
    """Dotted module name -> file, for the packages and the entry scripts beside them."""
    modules = {path.stem: path for path in ROOT.glob("*.py")}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return modules


def layer(module: str) -> int:
    return ENTRY_LAYER if module in ENTRY_POINTS else LAYERS.get(module.split(".")[0], ENTRY_LAYER)


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> Dict[str, int]:
    """The project modules ``name`` imports anywhere in its file, each with the line of its first import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]  # a name may be a module
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def import_graph() -> Edges:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: Edges) -> List[List[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    groups: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def upward(edges: Edges) -> List[str]:
    modules = project_modules()
    found = sorted((str(modules[m].relative_to(ROOT)) if m in modules else m, line, target)
                   for m, targets in edges.items() for target, line in targets.items() if layer(target) > layer(m))
    return [f"{path}:{line} imports {target}" for path, line, target in found]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_imports_point_down_the_layers() -> None:
    found = upward(import_graph())
    assert not found, "imports up the layers utils < image_datasets < trainer < entry scripts:\n" + "\n".join(found)


def test_entry_points_inside_packages_are_not_imported() -> None:
    edges = import_graph()
    for entry in ENTRY_POINTS:
        assert entry in edges, f"{entry} is gone: update ENTRY_POINTS"
        importers = sorted(m for m, targets in edges.items() if entry in targets and layer(m) < ENTRY_LAYER)
        assert not importers, f"{entry} is an entry point (run as a file), yet {importers} import it"


def test_the_walk_sees_every_kind_of_import() -> None:
    """Relative, dotted and function-local imports are all edges, so the checks above can fail."""
    edges = import_graph()
    assert "trainer.engine" in edges["trainer.cli"], "function-local (after argument parsing)"
    assert "utils.tiny_models.vlm" in edges["utils.tiny_models"], "relative (from .vlm import ...)"
    assert "trainer.cli" in edges["train"], "an entry script"
    assert "validate_dataset" in edges["utils.validate_dataset"], "the guide's path runs the root script"
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert upward({"utils.cuda_utils": {"trainer.config": 7}, "trainer.cli": {"utils.quiet": 3}}) == \
        ["utils/cuda_utils.py:7 imports trainer.config"]


MAX_LINES = 500
ENGINE_MAX_LINES = 560  # the recipe reads top to bottom in one file


def test_no_trainer_file_is_long() -> None:
    """Every module of trainer/, its sub-packages included, stays short enough to read in one sitting."""
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
               for path in (ROOT / "trainer").rglob("*.py")}
    assert len(lengths) > 60 and "trainer/run_folder/checkpoint.py" in lengths, "the walk must see the sub-packages"
    too_long = {name: n for name, n in lengths.items()
                if n > (ENGINE_MAX_LINES if name == "trainer/engine.py" else MAX_LINES)}
    assert not too_long, f"over {MAX_LINES} lines (engine.py: {ENGINE_MAX_LINES}): {too_long}"


TRAINER_MAX_ATTRIBUTES = 12  # the loop's own few; the run's parts are the phases' records (trainer/assembly.py)


def trainer_assignments() -> Dict[str, Dict[str, int]]:
    """Attribute of ``engine.Trainer`` -> {method that assigns ``self.<attribute>``: how many times}."""
    tree = ast.parse((ROOT / "trainer" / "engine.py").read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    found: Dict[str, Dict[str, int]] = {}
    for method in (node for node in trainer.body if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in (t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    per_method = found.setdefault(target.attr, {})
                    per_method[method.name] = per_method.get(method.name, 0) + 1
    return found


def test_the_trainer_keeps_a_dozen_attributes_each_set_once() -> None:
    """``Trainer`` holds the few attributes its loop needs; each is set in ``__init__`` and at most once
    more, by one set-up phase (its record of the run's parts), never refilled by a later phase."""
    found = trainer_assignments()
    assert {"cfg", "state", "env", "inputs", "model"} <= set(found), "the walk must see the assignments"
    assert len(found) <= TRAINER_MAX_ATTRIBUTES, f"{len(found)} attributes: {sorted(found)}"
    refilled = {name: methods for name, methods in found.items()
                if "__init__" not in methods or len(methods) > 2 or any(n > 1 for n in methods.values())}
    assert not refilled, f"set outside __init__, or by more than one phase: {refilled}"


def test_each_trainer_package_says_what_it_holds() -> None:
    """Each package's __init__ opens with a docstring, so a teammate learns its modules from one file."""
    missing = [init.parent.relative_to(ROOT).as_posix() for init in sorted((ROOT / "trainer").rglob("__init__.py"))
               if not ast.get_docstring(ast.parse(init.read_text()))]
    assert not missing, f"packages with no docstring in __init__.py: {missing}"
