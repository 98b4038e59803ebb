"""Committed results and docs name no machine's absolute paths (``/root/out``, ``/work/main/...``,
``/home/<user>/...``, a virtualenv's interpreter): ``scripts/relative_paths.py`` rewrites them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from relative_paths import ABSOLUTE, relative  # noqa: E402

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
