"""``benchmarks/`` is one measuring tool: its modules import each other one way (no circle), exactly one
of them writes ``docs/GPU_RESULTS.md``, and what is not a benchmark lives elsewhere (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
DOC = "GPU_RESULTS.md"


def benchmark_imports() -> Dict[str, Set[str]]:
    """Each benchmark module -> the benchmark modules it imports (``benchmarks.x``, ``from benchmarks
    import x``, or a bare ``import x`` as a script run from benchmarks/ would)."""
    names = {p.stem for p in BENCHMARKS.glob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for path in BENCHMARKS.glob("*.py"):
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "benchmarks":
                    found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
                elif parts[0] in names and node.level == 0:
                    found.add(parts[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    found.add(parts[1] if parts[0] == "benchmarks" and len(parts) > 1 else parts[0])
        graph[path.stem] = {name for name in found & names if name != path.stem}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every import circle, as the path that closes it (depth-first search)."""
    found: List[List[str]] = []

    def visit(node: str, path: List[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif len(path) < len(graph):
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_cycles_finds_a_circle_and_none_where_there_is_none() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}})
    assert not cycles({"a": {"b"}, "b": {"c"}, "c": set()})


def test_benchmark_modules_import_each_other_one_way() -> None:
    graph = benchmark_imports()
    assert graph["gpu_pass"] >= {"gpu_pass_docs", "gpu_pass_stages"}  # so the check below sees real edges
    assert not cycles(graph), cycles(graph)[:5]
    assert graph["gpu_pass_stages"] == set()  # the ground floor: the stage table and the results file


def test_one_module_names_docs_gpu_results_as_a_file() -> None:
    """Only ``gpu_pass_docs.py`` builds the doc's path; the others may mention it in prose only."""
    naming = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        strings = [n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if any(s in (DOC, f"docs/{DOC}") for s in strings):
            naming.append(path.name)
    assert naming == ["gpu_pass_docs.py"]


TEST_MODULES = {p.stem for p in (ROOT / "tests").rglob("*.py")} - {"__init__"}


def reaches_into_tests(source: str) -> List[str]:
    """What a benchmark's source takes from tests/: an import of ``tests.*`` or of a module named like one of
    tests/ (``import harness`` with tests/gpu on the path), or a path built onto ``"tests"`` (a sys.path entry)."""
    found: List[Tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found += [(node.lineno, f"import {n}") for n in names
                  if n.split(".")[0] == "tests" or n.split(".")[0] in TEST_MODULES]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and node.right.value == "tests":
            found.append((node.lineno, "a path into tests/"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_tests_check_finds_an_import_from_tests() -> None:
    source = ("import sys\nsys.path.insert(0, str(ROOT / 'tests' / 'gpu'))\nimport harness\n"
              "from tests.gpu import step_anatomy\nfrom benchmarks import harness\nimport torch\n")
    assert reaches_into_tests(source) == ["line 2: a path into tests/", "line 3: import harness",
                                          "line 4: import tests.gpu"]


def test_benchmarks_import_nothing_from_tests() -> None:
    """Imports run tests -> benchmarks (the GPU harness is ``benchmarks/harness.py``; tests/gpu re-exports it),
    never benchmarks -> tests."""
    found = {path.name: hits for path in sorted(BENCHMARKS.glob("*.py"))
             if (hits := reaches_into_tests(path.read_text(encoding="utf-8")))}
    assert "harness" in TEST_MODULES and (BENCHMARKS / "harness.py").is_file()  # the shim is there, so is the check
    assert not found, found


def test_the_tests_old_harness_paths_are_the_benchmarks_modules() -> None:
    """``import harness`` / ``import step_anatomy`` in tests/gpu give the benchmarks' modules themselves."""
    import subprocess
    import sys

    script = ("import sys; sys.path.insert(0, 'tests/gpu')\nimport harness, step_anatomy\n"
              "import benchmarks.harness, benchmarks.step_anatomy\n"
              "assert harness is benchmarks.harness and step_anatomy is benchmarks.step_anatomy\n"
              "assert harness.StepAnatomy is step_anatomy.StepAnatomy\n")
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)


def test_gpu_report_writes_its_own_file_not_the_doc() -> None:
    from benchmarks import gpu_report

    out = gpu_report.output_path(gpu_report.parse_args([]))
    assert out.parent == ROOT / "output" / "gpu_report" and out.name.startswith("GPU_REPORT-")
    assert out.resolve() != (ROOT / "docs" / DOC).resolve()


def called_names(path: Path) -> Set[str]:
    """Every name a module calls (``f(...)``, ``m.f(...)``, ``TABLE[k](...)`` as ``TABLE``)."""
    names: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func.value if isinstance(node.func, ast.Subscript) else node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_one_program_runs_measurements() -> None:
    """gpu_report.py measures nothing itself: it calls the pass (``gpu_pass.main``) and none of the sections;
    the measuring process (gpu_pass_measure.py) is started by the pass alone."""
    from benchmarks import report_sections

    measuring = {f.__name__ for f in report_sections.BUILDERS.values()} | {"BUILDERS", "measure_steps"}
    assert {"machine_section", "steps_section", "startup_section"} <= measuring
    calls = called_names(BENCHMARKS / "gpu_report.py")
    assert "main" in calls and not calls & measuring, calls & measuring
    starting = [path.name for path in sorted(BENCHMARKS.glob("*.py"))
                if any(isinstance(n, ast.Constant) and n.value == "benchmarks/gpu_pass_measure.py"
                       for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))]
    assert starting == ["gpu_pass.py"]


def test_the_report_stage_runs_only_when_named() -> None:
    from benchmarks import gpu_pass

    whole = [s.name for s in gpu_pass.selected_stages(gpu_pass.parse_args([]))]
    assert "report" not in whole and "qwen_step" in whole and len(whole) == len(gpu_pass.STAGES) - 1
    assert [s.name for s in gpu_pass.selected_stages(gpu_pass.parse_args(["--stages", "report"]))] == ["report"]


def test_gpu_report_stops_in_one_line_when_the_stage_failed(tmp_path: Path) -> None:
    import pytest
    from benchmarks import gpu_report

    ok = [{"kind": "stage", "stage": "report", "status": "ok"},
          {"kind": "markdown", "stage": "report", "section": "machine", "text": "## Machine"},
          {"kind": "markdown", "stage": "fp8", "section": "fp8", "text": "## not the report's"}]
    assert gpu_report.sections_of(ok, tmp_path) == ["## Machine"]
    failed = [{"kind": "error", "stage": "report", "error": "RuntimeError: boom"},
              {"kind": "stage", "stage": "report", "status": "failed"}]
    with pytest.raises(SystemExit, match=r"report stage failed: RuntimeError: boom \(its log: .*pass.log\)$"):
        gpu_report.sections_of(failed, tmp_path)
    with pytest.raises(SystemExit, match="report stage failed: stage timed out after 1800 s"):
        gpu_report.sections_of([{"kind": "stage", "stage": "report", "status": "timed out after 1800 s"}], tmp_path)


def test_the_fault_scan_is_a_script_not_a_benchmark() -> None:
    assert not (BENCHMARKS / "disk_full_scan.sh").exists()
    text = (ROOT / "scripts" / "disk_full_scan.sh").read_text(encoding="utf-8")
    assert "bash scripts/disk_full_scan.sh" in text and 'cd "$(dirname "$0")/.."' in text
