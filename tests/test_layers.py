"""Imports point one way: utils/ (platform) <- image_datasets/ <- trainer/ <- entry scripts.

The project's imports are read with ``ast``, module-level and function-local ones alike (a local
import that dodges a cycle is still a cycle), and the tests fail on any import cycle and on any import
that points up the layers. ``utils/validate_dataset.py`` is an entry point at the path the
project's guide gives (``python utils/validate_dataset.py --path DIR``): it sits with the entry scripts'
layer, and nothing may import it. So do the tiny models' registry and command (``utils.tiny_models`` and
its ``__main__``, ``python -m utils.tiny_models --family X``): each tiny model is its family's
(``trainer/families/<name>/tiny.py``), so the registry reads the family registry; the helpers beside it
(``derive``, ``text_encoders``, ``tokenizers``) know no family and stay in ``utils/``.

Inside ``trainer/`` the sub-packages are floors too (``TRAINER_FLOORS``, lowest first, the torch-free facts at
the bottom): no import runs back up the order, so no two of them import each other.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

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



# Inside trainer/: its sub-packages and top-level modules ("rooms"), lowest floor first. A room imports only
# rooms before it in this order, so no import runs back up and no two rooms import each other. The ground
# floor, ``facts``, holds what needs neither torch nor a config: trainer/facts/ (the optimizer table, the
# quantization formats) and the light half of trainer/families/ (FAMILY_FACTS: the registry, each family's
# spec, the published components), whose facts stay in their own family packages by design.
TRAINER_FLOORS = (
    "facts",
    "precision", "signals",  # what applies to the whole process, read from the environment
    "config",  # the typed config: its schema checks values against the facts
    "quantization",  # frozen weights in fewer bits: the families quantize text encoders with it
    "families",  # the families' runtimes (base.py, each <name>/family.py): they load, encode, predict
    "platform",  # attention, compile, fp8: decisions about the device, per family
    "step",  # one optimizer step
    "data",  # the engine's side of data: the mix, the feature cache
    "run_folder",  # what a run keeps on disk
    "model",  # the loaded transformer made trainable (adapters, block swap, prepare)
    "evaluation",
    "planner",
    "reporting",
    "distributed",
    "assembly",  # a config made into a run's parts: the engine, the judge and the GPU harness build with it
    "pipeline_stages",  # training across cards, one stage per process (uses the planner's split)
    "stage_training",  # pipeline_stages: N in the engine (the stages built and stepped by the loop)
    "judge", "engine",
    "cli", "launch",
)
# modules of trainer/families/ on the facts floor, besides
FAMILY_FACTS = ("spec", "components", "model_index", "comfyui_names", "old_paths")
# every package's __init__ (the registry, trainer.families, and each family's, which its spec imports)


def trainer_room(module: str, path: Path) -> str:
    """The room of a trainer/ module: its sub-package or top-level module, or ``facts`` for a family's light half
    ("" for trainer/__init__.py, which imports nothing)."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    if parts[1] == "families" and (parts[-1] in FAMILY_FACTS or path.name == "__init__.py"):
        return "facts"
    return parts[1]


def room_imports(edges: Edges) -> Dict[Tuple[str, str], List[str]]:
    """(importing room, imported room) -> the imports behind that arrow, as "file:line imports module"."""
    modules = project_modules()
    arrows: Dict[Tuple[str, str], List[str]] = {}
    for name, targets in edges.items():
        if not name.startswith("trainer.") or name not in modules:
            continue
        source = trainer_room(name, modules[name])
        for target, line in sorted(targets.items()):
            if not target.startswith("trainer.") or target not in modules:
                continue
            dest = trainer_room(target, modules[target])
            if source and dest and dest != source:
                where = f"{modules[name].relative_to(ROOT).as_posix()}:{line} imports {target}"
                arrows.setdefault((source, dest), []).append(where)
    return arrows


def back_up(arrows: Dict[Tuple[str, str], List[str]], order: Sequence[str] = TRAINER_FLOORS) -> List[str]:
    """The imports whose target sits on the same floor as, or above, the importing room in ``order``."""
    rank = {name: i for i, name in enumerate(order)}
    return [f"{where} ({source} -> {dest})" for (source, dest), found in sorted(arrows.items())
            if rank[dest] >= rank[source] for where in found]


def mutual_pairs(arrows: Dict[Tuple[str, str], List[str]]) -> List[Tuple[str, str]]:
    return sorted((a, b) for a, b in arrows if a < b and (b, a) in arrows)


def test_every_trainer_room_has_a_floor() -> None:
    modules = project_modules()
    rooms = {trainer_room(m, p) for m, p in modules.items() if m.startswith("trainer.")} - {""}
    assert rooms - set(TRAINER_FLOORS) == set(), f"rooms of trainer/ with no place in TRAINER_FLOORS: " \
        f"{sorted(rooms - set(TRAINER_FLOORS))} (put each where its imports allow)"
    gone = sorted(set(TRAINER_FLOORS) - rooms)
    assert not gone, f"TRAINER_FLOORS names rooms that are gone: {gone}"


def test_no_import_runs_back_up_the_trainer_floors() -> None:
    found = back_up(room_imports(import_graph()))
    assert not found, f"imports back up trainer/'s floors ({' < '.join(TRAINER_FLOORS)}):\n" + "\n".join(found)


def test_no_two_trainer_rooms_import_each_other() -> None:
    arrows = room_imports(import_graph())
    found = mutual_pairs(arrows)
    assert not found, "trainer/ rooms that import each other:\n" + "\n".join(
        f"{a} <-> {b}: {arrows[a, b][0]}; {arrows[b, a][0]}" for a, b in found)


def test_the_facts_floor_needs_no_torch() -> None:
    """The ground floor imports no torch, diffusers or transformers, so the config checks, the planner's tables
    and the web page read it without loading them (function-local imports count: the walk sees them too)."""
    modules = project_modules()
    heavy = ("torch", "diffusers", "transformers", "accelerate", "peft")
    found = []
    for name, path in modules.items():
        if name.startswith("trainer.") and trainer_room(name, path) == "facts":
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                          for n in names if n.split(".")[0] in heavy]
    facts = [m for m, p in modules.items() if m.startswith("trainer.") and trainer_room(m, p) == "facts"]
    assert "trainer.facts.optimizer_choices" in facts and "trainer.families.wan.spec" in facts and len(facts) > 15
    assert not found, "the facts floor imports a heavy library:\n" + "\n".join(found)
    # and none through utils/: import the whole floor in a fresh interpreter and look
    script = (f"import importlib, sys\nfor m in {facts!r}: importlib.import_module(m)\n"
              f"print(sorted({{k.split('.')[0] for k in sys.modules}} & {set(heavy)!r}))")
    loaded = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "ZYGOTE": "0"}).stdout.strip()  # fresh: not tests/zygote.py's

    assert loaded == "[]", f"importing the facts floor loads {loaded}"


def test_the_floor_checks_can_fail() -> None:
    """A made-up import back up, and a made-up pair, are both found (the checks above are not vacuous)."""
    arrows = room_imports({"trainer.config.schema": {"trainer.step.optim": 26},
                           "trainer.step.optim": {"trainer.config": 24},
                           "trainer.families.wan.spec": {"trainer.families.base": 3},
                           "trainer.families.wan.family": {"trainer.families.wan.spec": 9}})
    assert mutual_pairs(arrows) == [("config", "step"), ("facts", "families")]  # a spec is facts, its model is not
    assert back_up(arrows) == ["trainer/config/schema.py:26 imports trainer.step.optim (config -> step)",
                               "trainer/families/wan/spec.py:3 imports trainer.families.base (facts -> families)"]



# Modules left at an old import path, each the same module object as its new home's (``sys.modules``), so
# that users' imports keep working; they hold nothing of their own.
OLD_PATHS = {"trainer/step/optimizer_specs.py": "trainer.facts.optimizer_choices",
             "trainer/model/quantization.py": "trainer.quantization.frozen_weights",
             "trainer/model/quantized_linear.py": "trainer.quantization.w8a8_linear",
             "trainer/planner/model.py": "trainer.planner.model_sizes",
             "trainer/families/spec.py": "trainer.facts.family_spec"}


def test_old_import_paths_are_their_new_modules() -> None:
    """Each old path is the moved module itself, so a name set through either path (a test's monkeypatch,
    a user's override) is seen through both."""
    script = "import importlib\n" + "".join(
        f"assert importlib.import_module({old.removesuffix('.py').replace('/', '.')!r}) is "
        f"importlib.import_module({new!r}), {old!r}\n" for old, new in OLD_PATHS.items())
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)


def test_file_names_say_one_thing_across_trainer() -> None:
    """A file name names one kind of thing: two files of trainer/ share a name only as the same part of two
    families (``families/<name>/spec.py``, ``family.py``, ``tiny.py``, ``attention.py``) or as an old import path.
    "model" names the trainable transformer (``trainer/model/``) only: a family's runtime is its ``family.py``."""
    files = [path.relative_to(ROOT).as_posix() for path in (ROOT / "trainer").rglob("*.py")
             if path.name not in ("__init__.py", "__main__.py")]
    by_name: Dict[str, List[str]] = {}
    for name in files:
        if name not in OLD_PATHS:
            by_name.setdefault(name.rsplit("/", 1)[-1], []).append(name)
    one_family_part = re.compile(r"trainer/families/[a-z0-9_]+/[a-z0-9_]+\.py")
    shared = {base: names for base, names in by_name.items()
              if len(names) > 1 and not all(one_family_part.fullmatch(n) for n in names)}
    assert "family.py" in by_name and len(by_name["family.py"]) >= 8, "the walk must see the families' files"
    assert not shared, f"file names shared by different things in trainer/: {shared}"
    assert not runtimes_named_model(files), f"a family's runtime is its family.py: {runtimes_named_model(files)}"


def runtimes_named_model(files: List[str]) -> List[str]:
    """The files of trainer/families/ named model.py or model/ (the name is the trainable transformer's)."""
    return [name for name in files if re.fullmatch(r"trainer/families/.*\bmodel(\.py|/.*)", name)]


def test_the_model_name_check_can_fail() -> None:
    """A family's model.py coming back is found; trainer/model/ and the families' family.py are not."""
    assert runtimes_named_model(["trainer/families/flux/model.py", "trainer/families/flux/family.py",
                                 "trainer/model/adapters.py", "trainer/families/model_index.py"]) == \
        ["trainer/families/flux/model.py"]


def test_old_family_runtime_paths_are_their_new_modules() -> None:
    """``trainer.families.<name>.model`` (each family's runtime before it became ``family.py``) is the same module
    object as ``<name>.family`` for every family of the registry, in import, attribute and from-import forms."""
    script = ("import importlib\nfrom trainer.families import SPECS\nimport trainer.families.qwen_image.model as m\n"
              "from trainer.families.krea2.model import Krea2Family\n"
              "assert m is importlib.import_module('trainer.families.qwen_image.family')\n"
              "assert Krea2Family is importlib.import_module('trainer.families.krea2.family').Krea2Family\n"
              "for name, spec in SPECS.items():\n"
              "    new = importlib.import_module(f'trainer.families.{name}.family')\n"
              "    assert importlib.import_module(f'trainer.families.{name}.model') is new, name\n"
              "    assert new.__spec__.name == new.__name__ == f'trainer.families.{name}.family', new.__spec__\n"
              "    assert getattr(new, spec.runtime).__module__ == new.__name__, name\n"
              "print(len(SPECS))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 9


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
