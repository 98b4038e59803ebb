"""Rewrite the absolute paths of the machine that ran a measurement as paths that mean something
anywhere: inside the repository -> relative to its root, a home folder -> ``~``, a virtualenv's
interpreter -> its bare name, its site-packages -> ``site-packages/``.

Raw result files (``benchmarks/results/``) and the docs that quote them are committed; an absolute
path in them names one machine's layout (``/root/out``, ``/work/main/tests/...``) and tells a reader
nothing. ``tests/test_result_paths.py`` fails on one; the GPU pass (``benchmarks/gpu_pass.py``)
writes its raw files through ``relative`` so a new pass's results need no manual step.

    python scripts/relative_paths.py FILE...      # rewrites the files in place, prints what changed
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import List, Pattern, Tuple

# A path starts where no word, dot, tilde, dollar, slash or dash precedes its slash, so relative
# paths (``a/root/b``, ``../work``) and names like ``/tmp/pytest-of-root`` are left alone.
_START = r"(?<![\w.~$/-])"
_PART = r"[^/\s'\"`,;:()\[\]]+"  # one path component: up to a separator or the text around a path

# Order matters: the interpreter and site-packages rules see the full path before the home rule
# could shorten its start.
RULES: List[Tuple[Pattern[str], str]] = [
    (re.compile(_START + rf"(?:/{_PART})+/\.venv/bin/(python[\d.]*)"), r"\1"),
    (re.compile(_START + rf"(?:/{_PART})+/\.venv/lib/python[\d.]+/site-packages/"), "site-packages/"),
    (re.compile(_START + rf"/work/{_PART}/"), ""),  # a checkout under /work: repository-relative
    (re.compile(_START + rf"/work/{_PART}"), "."),
    (re.compile(_START + rf"/(?:root|home/{_PART}|Users/{_PART})(?=/)"), "~"),
    (re.compile(_START + rf"/(?:root|home/{_PART}|Users/{_PART})(?![\w/.-])"), "~"),
]

# What the test refuses: a home or /work path, or any path into a virtualenv.
ABSOLUTE: Pattern[str] = re.compile(
    _START + rf"/(?:root|work|home/{_PART}|Users/{_PART})(?![\w.-])|" + _START + rf"(?:/{_PART})+/\.venv/")


def relative(text: str) -> str:
    """``text`` with every machine-specific absolute path rewritten (see the module docstring)."""
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text


def rewrite(path: Path) -> bool:
    """Rewrite ``path`` in place; True when it changed. Files that are not UTF-8 text are skipped."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:  # newline="": keep a log's \r (progress bars) as is
            text = fh.read()
    except (UnicodeDecodeError, IsADirectoryError):
        return False
    new = relative(text)
    if new != text:  # a temporary file then a rename: a crash mid-write leaves the old file whole
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(new)
        os.replace(tmp, path)
    return new != text


def rewrite_folder(folder: Path) -> List[Path]:
    """Rewrite every file directly in ``folder`` (a pass's --out holds no sub-folders); the changed ones."""
    return [path for path in sorted(Path(folder).iterdir()) if path.is_file() and rewrite(path)]


def main(argv: List[str]) -> int:
    """Rewrite each file named on the command line; print the ones that changed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="result or doc files, rewritten in place")
    args = parser.parse_args(argv)
    missing = [str(name) for name in args.files if not name.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    for name in args.files:
        if rewrite(name):
            print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
