"""Committed results and docs name no machine's absolute paths (``/root/out``, ``/work/main/...``,
``/home/<user>/...``, a virtualenv's interpreter): ``utils/relative_paths.py`` rewrites them, and the GPU
pass writes its raw files through it (``python scripts/relative_paths.py FILE...`` for older files)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from benchmarks import gpu_pass
from utils.relative_paths import ABSOLUTE, relative

ROOT = Path(__file__).resolve().parents[1]

CHECKED = ("benchmarks/results", "docs")


def committed_text_files() -> List[Path]:
    """The files git tracks under ``CHECKED`` (every file there when this is not a git checkout)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", *CHECKED], cwd=ROOT, capture_output=True, check=True,
                               text=True).stdout.split("\0")
        files = [ROOT / name for name in names if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p for folder in CHECKED for p in (ROOT / folder).rglob("*") if p.is_file()]
    return [p for p in files if p.is_file() and p.suffix not in (".png", ".jpg", ".webp")]


def test_no_committed_result_or_doc_holds_an_absolute_machine_path() -> None:
    found = []
    for path in committed_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            match = ABSOLUTE.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert committed_text_files(), "no files checked: the folders moved?"
    assert not found, ("absolute paths of the machine that wrote them (run `python scripts/relative_paths.py "
                       "FILE...` to rewrite them):\n" + "\n".join(found[:40]))


@pytest.mark.parametrize("text, want", [
    ("/opt/torch/.venv/bin/python3 benchmarks/gpu_pass_measure.py machine --out /root/out",
     "python3 benchmarks/gpu_pass_measure.py machine --out ~/out"),
    ('File "/work/main/tests/gpu/harness.py", line 390', 'File "tests/gpu/harness.py", line 390'),
    ("rootdir: /work/main", "rootdir: ."),
    ("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn.py:3", "site-packages/torch/nn.py:3"),
    ('{"out": "/home/alice/runs/a"}', '{"out": "~/runs/a"}'),
    ("--junitxml=/root/out/junit.xml", "--junitxml=~/out/junit.xml"),
])
def test_absolute_paths_are_found_and_rewritten(text: str, want: str) -> None:
    assert ABSOLUTE.search(text)  # so the test above can fail
    assert relative(text) == want and not ABSOLUTE.search(want)


@pytest.mark.parametrize("text", ["/tmp/pytest-of-root/pytest-0/popen-gw2", "a/root/b ../work/x",
                                  ". .venv/bin/activate", "/data/qwen-full", "benchmarks/results/x.json"])
def test_relative_and_temporary_paths_are_left_alone(text: str) -> None:
    assert not ABSOLUTE.search(text) and relative(text) == text


def test_the_gpu_pass_writes_its_raw_files_with_relative_paths(tmp_path: Path) -> None:
    """A stage's output, the pass's records, pytest's junit.xml and a file a measurement wrote itself
    (machine.txt) come out of the pass with no /work/<checkout>/ or home path: nothing to rewrite by hand."""
    out = tmp_path / "out"
    out.mkdir()
    p = gpu_pass.Pass(out, tmp_path / "work", budget_s=60.0, dry_run=True, t0=time.time())
    p.log = open(out / gpu_pass.LOG, "a", encoding="utf-8")
    raw = ('File "/work/h-x/tests/gpu/harness.py", line 3\nrootdir: /work/h-x\n'
           "/opt/t/.venv/bin/python3 run --out /root/out\n")
    with open(out / gpu_pass.TESTS, "a", encoding="utf-8") as also:
        done = gpu_pass.run_process(p, "stage", [sys.executable, "-c", f"print({raw!r}, end='')"], 30,
                                    p.child_env(), also)
    p.record("stage", stage="x", command="/work/h-x/.venv/bin/python benchmarks/gpu_pass_measure.py x",
             out="/work/h-x/output/run")
    (out / gpu_pass.JUNIT).write_text('<testsuite><testcase file="/work/h-x/tests/gpu/test_a.py" name="t" '
                                      'time="1"/></testsuite>')
    gpu_pass.record_tests(p, "tests", "ok")
    (out / gpu_pass.MACHINE).write_text("python: /home/alice/.venv/bin/python3.12\n")
    gpu_pass.finish(p)
    assert done["status"] == "ok"
    log = (out / gpu_pass.LOG).read_text()
    assert 'File "tests/gpu/harness.py", line 3' in log and "rootdir: ." in log and "python3 run --out ~/out" in log
    assert (out / gpu_pass.TESTS).read_text() == relative(raw)
    records = gpu_pass.read_records(p.results)
    stage = next(r for r in records if r.get("stage") == "x")
    assert stage["command"] == "python benchmarks/gpu_pass_measure.py x" and stage["out"] == "output/run"
    assert next(r for r in records if r["kind"] == "test")["id"] == "tests/gpu/test_a.py::t"
    assert (out / gpu_pass.MACHINE).read_text() == "python: python3.12\n"
    for path in out.iterdir():
        found = [line for line in path.read_text().splitlines() if ABSOLUTE.search(line)]
        assert not found, (path.name, found)
