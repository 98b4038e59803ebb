"""Rewrite the machine-specific absolute paths in result files (the rules: ``utils/relative_paths.py``).

    python scripts/relative_paths.py FILE...      # rewrites the files in place, prints what changed
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.relative_paths import ABSOLUTE, RULES, main, relative, rewrite, rewrite_folder  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
