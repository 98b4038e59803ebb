"""``benchmarks/`` is one measuring tool: its modules import each other one way (no circle), exactly one
of them writes ``docs/GPU_RESULTS.md``, and what is not a benchmark lives elsewhere (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

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


def test_gpu_report_writes_its_own_file_not_the_doc() -> None:
    from benchmarks import gpu_report

    out = gpu_report.output_path(gpu_report.parse_args([]))
    assert out.parent == ROOT / "output" / "gpu_report" and out.name.startswith("GPU_REPORT-")
    assert out.resolve() != (ROOT / "docs" / DOC).resolve()


def test_the_fault_scan_is_a_script_not_a_benchmark() -> None:
    assert not (BENCHMARKS / "disk_full_scan.sh").exists()
    text = (ROOT / "scripts" / "disk_full_scan.sh").read_text(encoding="utf-8")
    assert "bash scripts/disk_full_scan.sh" in text and 'cd "$(dirname "$0")/.."' in text
